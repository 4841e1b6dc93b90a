"""Loop the old batched comparison of test_new_engine_resumes_from_the_server (6a66073^) with margins."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "reference_impl/tests/vllm_engine"))

import enginekit as ek  # noqa: E402
from hybridkv.server.front.cli import parse  # noqa: E402
from hybridkv.server.front.launch import start_server  # noqa: E402

LENGTHS = [129, 200, 255, 256, 257, 300, 383, 450, 511, 513, 600, 640, 777, 900, 1023, 1025, 1100, 1300, 1500,
           1700, 2000, 2049]
PICK = [0, 3, 7, 12, 18, 21]
OUT = Path(os.environ.get("REPRO_OUT", "/tmp/repro"))


def gen(llm, prompts, salts=None, max_tokens=12):
    from vllm import SamplingParams
    items = []
    for i, p in enumerate(prompts):
        it = {"prompt_token_ids": p}
        if salts and salts[i]:
            it["cache_salt"] = salts[i]
        items.append(it)
    outs = llm.generate(items, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = []
        for d in c.logprobs:
            top = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:3]
            lps.append([(t, float(lp.logprob)) for t, lp in top])
        res.append({"tokens": list(c.token_ids), "cached": int(o.num_cached_tokens or 0), "lps": lps})
    return res


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def margin(lps, pos):
    top = lps[pos]
    return top[0][1] - top[1][1] if len(top) > 1 else float("inf")


ALL = None


def hooks(llm, name):
    if os.environ.get("REPRO_HOOKS") != "1":
        return
    path = str(OUT / f"hooks-{name}.jsonl")
    scratch = str(Path(__file__).resolve().parent)

    def _install(worker):
        import sys as _s
        _s.path.insert(0, scratch)
        import hooks as H
        return H.install(worker, path)
    llm.collective_rpc(_install)


def compare(tag, it, got, ref, prompts_idx, log):
    ALL.write(json.dumps({"tag": tag, "iter": it, "runs": got}) + "\n")
    ALL.flush()
    bad = []
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        d = first_diff(g["tokens"], r["tokens"])
        if d is not None:
            rec = {"tag": tag, "iter": it, "prompt": prompts_idx[k], "len": LENGTHS[prompts_idx[k]], "pos": d,
                   "cached": g["cached"], "ref_margin": margin(r["lps"], d), "got_margin": margin(g["lps"], d),
                   "ref_top": r["lps"][d], "got_top": g["lps"][d]}
            bad.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print("MISMATCH", rec, flush=True)
    return bad


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    OUT.mkdir(parents=True, exist_ok=True)
    log = open(OUT / "mismatches.jsonl", "a")  # noqa: SIM115 (appended to as the loop runs)
    global ALL
    ALL = open(OUT / "all.jsonl", "a")  # noqa: SIM115
    d = Path(tempfile.mkdtemp(prefix="hkv-repro-"))
    model = ek.write_model(d / "tiny")
    sock = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    l1 = tempfile.mkdtemp(prefix="hkv-", dir="/dev/shm")
    srv = start_server(parse([f"--endpoint=ipc://{sock}/s.sock", "--l1-dir", l1, "--admin", "--l1-gib=0.25"]))
    prompts = [ek.prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    picked = [prompts[i] for i in PICK]
    try:
        t0 = time.time()
        llm = ek.make_llm(model, srv.endpoint)
        hooks(llm, "engine1")
        print("engine start", time.time() - t0, flush=True)
        half = len(prompts) // 2
        cold = gen(llm, prompts[:half]) + gen(llm, prompts[half:])
        assert all(g["cached"] == 0 for g in cold)
        ALL.write(json.dumps({"tag": "cold22", "iter": -1, "runs": cold}) + "\n")
        ek.forget_local(llm)
        cold_ref = [cold[i] for i in PICK]
        (OUT / "cold.json").write_text(json.dumps({"cold": cold}))
        # like with like in engine 1: warm batched
        w1 = gen(llm, picked)
        compare("engine1-warm-batched", -1, w1, cold_ref, PICK, log)
        ek.close_llm(llm)
        ek.server_settled(srv.endpoint)
        # cold batched of the same 6 in a fresh engine without the connector
        if os.environ.get("REPRO_NOCONN", "1") == "1":
            nc = ek.make_llm(model, None)
            cb = gen(nc, picked)
            compare("noconn-cold-batched-vs-cold22", -1, cb, cold_ref, PICK, log)
            for r in range(3):
                vw = gen(nc, picked)  # vLLM's own prefix cache: warm batched, no connector
                hits = [g["cached"] for g in vw]
                assert hits == [(len(p) - 1) // 128 * 128 for p in picked], hits
                compare(f"noconn-vllmcache-warm-batched{r}", -1, vw, cold_ref, PICK, log)
            alone = []
            for p in picked:
                assert nc.reset_prefix_cache()
                alone += gen(nc, [p])
            compare("noconn-cold-alone", -1, alone, cold_ref, PICK, log)
            (OUT / "cold_b6.json").write_text(json.dumps({"cold_batched6": cb}))
            ek.close_llm(nc)
        total = 0
        nbad = 0
        for it in range(iters):
            t0 = time.time()
            fresh = ek.make_llm(model, srv.endpoint)
            hooks(fresh, f"fresh{it}")
            try:
                w = gen(fresh, picked)
                assert [g["cached"] for g in w] == [(len(p) - 1) // 128 * 128 for p in picked], [g["cached"] for g in w]
                nbad += len(compare("fresh-warm-batched", it, w, cold_ref, PICK, log))
                total += 1
                for r in range(repeats):
                    ek.forget_local(fresh)
                    w = gen(fresh, picked)
                    nbad += len(compare(f"fresh-warm-batched-repeat{r}", it, w, cold_ref, PICK, log))
                    total += 1
            finally:
                ek.close_llm(fresh)
            print(f"iter {it} done in {time.time() - t0:.1f}s; batches {total}, mismatches {nbad}", flush=True)
    finally:
        srv.close()
        shutil.rmtree(l1, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
