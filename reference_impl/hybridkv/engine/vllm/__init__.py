"""The vLLM 0.33 connector: `HybridKVConnector` in `hybridkv.engine.vllm.connector`.

The only package of hybridkv that imports vllm; load it with
`"kv_connector_module_path": "hybridkv.engine.vllm.connector"`.
"""
