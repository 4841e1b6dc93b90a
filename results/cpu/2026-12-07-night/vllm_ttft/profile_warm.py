"""Where a warm request's time goes: each vLLM call on its path, through hybridkv in a new engine, beside vLLM's
own prefix-cache hit of the same prompt in the same engine right after it.

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 [VLLM_ENABLE_V1_MULTIPROCESSING=0] \
    PYTHONPATH=$PWD/reference_impl:$PWD/kernels:$PWD/harness:$PWD/results/cpu/2026-12-07-night/vllm_ttft \
    /work/main/.nox/vllm_engine/bin/python results/cpu/2026-12-07-night/vllm_ttft/profile_warm.py OUT.json \
        [--lengths 8192 16384] [--repeats 3] [--decode 2]

The model and engine of `scenarios/vllm_real/ttft_cpu_8k16k.toml`. Engine A computes each prompt once (its
stores fill the server) and closes; engine B then asks each prompt `repeats` times through hybridkv (vLLM's own
prefix cache reset before each: only hybridkv can hit) and each time again at once from vLLM's own prefix
cache. The connector is `profiled_connector.ProfiledHybridKVConnector`: a timestamp at each vLLM call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.vllm_real import engine_args, load_ttft_scenario, prompt, server_settled, write_model

SCENARIO = Path(__file__).resolve().parents[4] / "scenarios/vllm_real/ttft_cpu_8k16k.toml"


def _engine(model: Path, sc, endpoint: str):
    from vllm import LLM

    args = engine_args(model, sc, endpoint)
    args["kv_transfer_config"] |= {"kv_connector": "ProfiledHybridKVConnector",
                                   "kv_connector_module_path": "profiled_connector"}
    return LLM(**args)


def _run(llm, tokens: list[int], n: int):
    from vllm import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": tokens}],
                          SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=2, help="tokens per request (TTFT needs the first only)")
    a = ap.parse_args()
    sc = load_ttft_scenario(SCENARIO)
    work = Path(tempfile.mkdtemp(prefix="hkv-prof-"))
    shm = Path(tempfile.mkdtemp(prefix="hkv-prof-", dir="/dev/shm"))
    log = work / "marks.jsonl"
    os.environ["HKV_PROFILE_LOG"] = str(log)
    requests = []
    try:
        model = write_model(work / "model", sc.model)
        server = start_server(ServerConfig(endpoint=f"ipc://{work}/server.sock", l1_bytes=int(sc.l1_gib * GIB),
                                           l1_dir=str(shm), admin=True))
        try:
            prompts = {n: prompt(n, 1000 + i, sc.model.vocab) for i, n in enumerate(a.lengths)}
            first = _engine(model, sc, server.endpoint)
            _run(first, prompt(64, 7, sc.model.vocab), 2)
            cold = {n: list(_run(first, p, a.decode).outputs[0].token_ids) for n, p in prompts.items()}
            server_settled(server.endpoint)
            first.llm_engine.engine_core.shutdown()
            del first
            second = _engine(model, sc, server.endpoint)
            _run(second, prompt(64, 8, sc.model.vocab), 2)
            for n, p in prompts.items():
                for r in range(a.repeats):
                    for kind in ("hybridkv", "vllm"):
                        t0 = time.monotonic()
                        out = _run(second, p, a.decode)
                        requests.append(dict(kind=kind, tokens=n, repeat=r, rid=out.request_id, t0=t0,
                                             t1=time.monotonic(), ttft=out.metrics.first_token_latency,
                                             cached=out.num_cached_tokens,
                                             equal=list(out.outputs[0].token_ids) == cold[n]))
                    second.reset_prefix_cache()
            second.llm_engine.engine_core.shutdown()
        finally:
            server.close()
        marks = [json.loads(line) for line in log.read_text().splitlines()]
        Path(a.out).write_text(json.dumps({"requests": requests, "marks": marks}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
