"""`hybridkv vllm-replay`: RAG, chat and system-prompt fan-out traffic replayed through real vLLM engines, each
request's hit through hybridkv beside vLLM's own prefix cache in the same run (`spec`: the scenario file; `rows`:
what each request records and a workload's figures; `run`: the engines; `report`: replay.csv, replay.png, report.md)."""
