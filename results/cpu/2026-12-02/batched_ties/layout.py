"""Same engine, same local-prefix-cache KV (vLLM's own, no connector): the six prompts' warm continuations under
step layouts A and B, forced by adding requests between single engine steps (in-process engine core)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before repro's defaults and vLLM's import
sys.path.insert(0, str(Path(__file__).resolve().parent))
from repro import LENGTHS, PICK, ek  # noqa: E402  (the environment, the prompts' lengths and the six picked)

COMPS: list = []


def _hook(worker):
    mr = worker.model_runner
    orig = mr.execute_model

    def ex(so, *a, **k):
        COMPS.append(dict(so.num_scheduled_tokens))
        return orig(so, *a, **k)
    mr.execute_model = ex
    return 0


def run_staged(llm, stages, prompts, tag):
    from vllm import SamplingParams
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    COMPS.clear()
    for si, stage in enumerate(stages):
        for i in stage:
            eng.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, sp)
        if si < len(stages) - 1:
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    res = {}
    for i in sum(stages, []):
        o = outs[f"{tag}-{i}"]
        c = o.outputs[0]
        lps = [sorted(((t, float(lp.logprob)) for t, lp in d.items()), key=lambda x: -x[1])[:2] for d in c.logprobs]
        res[i] = {"tokens": list(c.token_ids), "cached": int(o.num_cached_tokens or 0), "lps": lps}
    lens = {f"{tag}-{i}": len(prompts[i]) for i in sum(stages, [])}
    layout = [" ".join(f"{lens.get(r, r)}:{n}" for r, n in c.items()) for c in COMPS if c]
    return res, layout


def main():
    d = Path(tempfile.mkdtemp(prefix="hkv-layout-"))
    model = ek.write_model(d / "tiny")
    prompts = [ek.prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    p6 = [prompts[i] for i in PICK]  # 0:129 1:256 2:450 3:777 4:1500 5:2049
    llm = ek.make_llm(model, None)
    llm.collective_rpc(_hook)
    cold, lay = run_staged(llm, [[0, 1, 2, 3, 4, 5]], p6, "cold")
    print("cold layout", lay[:12])
    A = [[0], [1, 2, 3], [4, 5]]
    B = [[0, 1], [2, 3, 4, 5]]
    out = []
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        for name, st in (("A", A), ("B", B)):
            res, lay = run_staged(llm, st, p6, f"{name}{r}")
            print(name, r, "layout", " | ".join(lay[:3]), "cached", [res[i]["cached"] for i in range(6)])
            print("   777 tokens", res[3]["tokens"], "pos2 top2", res[3]["lps"][2])
            out.append({"layout": name, "rep": r, "steps": lay, "res": res})
    print("cold 777 tokens", cold[3]["tokens"], "pos2 top2", cold[3]["lps"][2])
    Path(os.environ.get("LAYOUT_OUT", "/tmp/layout.json")).write_text(json.dumps({"cold": cold, "runs": out}))
    ek.close_llm(llm)


if __name__ == "__main__":
    main()
