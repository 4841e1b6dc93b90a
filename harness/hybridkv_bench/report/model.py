"""The report's real-model section: measured TTFT beside modeled, per phase, and the logits oracle's verdict.

Only runs whose request rows carry measured prefill times (the `transformers` engine) get it.
"""

from __future__ import annotations

import math

import msgspec
import pandas as pd

from hybridkv_bench.report.tables import markdown_table
from hybridkv_bench.results.folder import Run


def _mean(values: pd.Series) -> float | None:
    v = values.dropna()
    return float(v.mean()) if len(v) else None


def model_section(run: Run, df: pd.DataFrame) -> list[str]:
    """Markdown lines of the section, or none for a run without a real model."""
    req = pd.DataFrame([msgspec.structs.asdict(r) for r in run.requests if r.repeat >= 0])
    if req.empty or req.ttft_measured_s.isna().all():
        return []
    rows = []
    for (wl, case, phase), g in req.groupby(["workload", "case", "phase"], sort=False):
        rows.append([wl, case, phase, _mean(g.lookup_s), _mean(g.load_s), _mean(g.prefill_s),
                     _mean(g.prefill_measured_s), _mean(g.ttft_s), _mean(g.ttft_measured_s), _mean(g.adapter_s),
                     _mean(g.forward_alone_s), _mean(g.warm_pipeline_ratio)])
    verdicts = []
    for r in df[df.status == "ok"].to_dict("records"):
        ok = r.get("oracle_pass")
        ok = None if isinstance(ok, float) and math.isnan(ok) else ok
        verdicts.append([r["workload"], r["case"], {None: "not run", True: "PASS", False: "**FAIL**"}[ok],
                         r.get("logits_bitwise_equal"), r.get("logits_max_abs_diff"), r.get("ttft_cold_measured_s"),
                         r.get("ttft_cold_s"), r.get("ttft_warm_measured_s"), r.get("ttft_speedup_measured")])
    return [
        "## Real model: measured beside modeled", "",
        "The engine ran a transformers model (random weights from the config). Measured prefill = the model's "
        "forwards (cold: the whole prompt; warm: the tokens after the hit). Modeled = the prefill model above. "
        "Adapter = copies between transformers' cache tensors and the pages, which vLLM does not pay (its kernels "
        "use the pages directly): in neither TTFT. A measured warm TTFT above the modeled one is transformers' "
        "eager forward (no CUDA graphs, no paged kernels), not the cache. Forward alone = the warm continuation "
        "from an in-memory cache (no load); pipeline ratio = measured warm TTFT / max(load, forward alone): 1.0 "
        "when a layer-wise load hides behind the forward (`[transformers] load = \"layerwise\"`), about 2 when "
        "they take as long and run one after the other.", "",
        markdown_table(["workload", "case", "phase", "lookup s", "load s", "prefill modeled s", "prefill measured s",
                        "TTFT modeled s", "TTFT measured s", "adapter s", "forward alone s", "pipeline ratio"], rows,
                       "lllrrrrrrrrr"), "",
        "Oracle: the warm continuation from the restored cache against the in-memory cache at the same split "
        "(bitwise) and one full prefill (max |diff|; judged in float32, reported in bfloat16). Speed-up = the "
        "smaller of measured and modeled cold TTFT over the measured warm TTFT.", "",
        markdown_table(["workload", "case", "oracle", "bitwise", "max abs diff vs full", "cold measured s",
                        "cold modeled s", "warm measured s", "speed-up"], verdicts, "lllllrrrr"), ""]
