"""Prefill throughput with the connector storing, `state_every_chunks` 0 / 1 / 4 interleaved in one engine (vLLM's
engine core in this process, so the scheduler side's setting is switched between rounds, under the same load):
16 prompts of 3,000 tokens in one batch (vLLM's default budget of 4,096 tokens, max_num_seqs 16) and one prompt
alone, fresh prompts each time (no hit anywhere).

    PYTHONPATH=... python prefill_throughput.py OUT.json ROUNDS
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "reference_impl/tests/vllm_engine"))
for k, v in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"), ("VLLM_LOGGING_LEVEL", "WARNING"),
             ("VLLM_ALLOW_INSECURE_SERIALIZATION", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
    os.environ[k] = v


def main() -> None:
    import enginekit as ek
    from hybridkv.server.front.cli import parse
    from hybridkv.server.front.launch import start_server
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    out, rounds = sys.argv[1], int(sys.argv[2])
    model = Path(tempfile.mkdtemp(prefix="hkvm-")) / "tiny"
    ek.write_model(model)
    sock, l1 = tempfile.mkdtemp(prefix="hkv-", dir="/tmp"), tempfile.mkdtemp(prefix="hkv-", dir="/dev/shm")
    srv = start_server(parse([f"--endpoint=ipc://{sock}/s.sock", "--l1-dir", l1, "--admin", "--l1-gib=2"]))
    llm = LLM(model=str(model), dtype="bfloat16", enable_prefix_caching=True, max_model_len=8192, enforce_eager=True,
              max_num_seqs=16, seed=0, kv_cache_memory_bytes=256 << 20, disable_log_stats=True,
              kv_transfer_config=ek.kv_transfer_config(srv.endpoint))
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    worker = get_kv_transfer_group().worker_side
    res: dict = {}
    seed = 0
    for _ in range(rounds):
        for every in (0, 1, 4):
            side.settings = dataclasses.replace(side.settings, state_every_chunks=every)
            for label, n in (("batch16", 16), ("one", 1)):
                seed += 100
                prompts = [ek.prompt(3000, seed=seed + i) for i in range(n)]
                before = worker.stats.stored_bytes
                t = time.perf_counter()
                ek.generate(llm, prompts, max_tokens=1)
                dt = time.perf_counter() - t
                worker.wait_idle(30)
                res.setdefault(f"{label}/every{every}", []).append(
                    {"s": dt, "tok_s": 3000 * n / dt, "stored_bytes": worker.stats.stored_bytes - before})
                print(label, every, f"{dt:.2f} s", flush=True)
    Path(out).write_text(json.dumps(res, indent=1))
    ek.close_llm(llm)
    srv.close()
    shutil.rmtree(l1, ignore_errors=True)


if __name__ == "__main__":
    main()
