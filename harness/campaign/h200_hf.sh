#!/usr/bin/env bash
# The real-model run on the H200 (issue 11): scenario h200_hf_oracle, a random-initialised Qwen3.5 text model
# at the Qwen3.6-27B shape (bf16), one document cold then warm through the shm path, with the logits oracle.
# Run from the repository root on the GPU machine (transformers >= 5.16.1 installed; fla optional):
#   bash harness/campaign/h200_hf.sh OUT [TOKENS] [FLA_WHEEL_DIR]
# TOKENS (default 55664 = 71 x 784) shrinks the document via --quick for a machine without fla, whose torch
# fallback prefills 8k tokens in ~2 s; FLA_WHEEL_DIR, when given, is pip-installed first (fla-core and
# flash-linear-attention wheels, no network needed). The run folder (run.json, requests.csv, report.md,
# plots) lands in OUT/hf_oracle; the gate's verdict (invariants, oracle_pass among them) in OUT/gate.txt.
set -euo pipefail
out=${1:?output directory}
tokens=${2:-55664}
fla=${3:-}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -n "$fla" ]; then
  python3 -m pip install --no-index --no-deps "$fla"/*.whl > "$out/fla-install.log" 2>&1 || {
    echo "fla wheels did not install (see $out/fla-install.log); the torch fallback runs" >&2; }
fi
python3 - <<'PY' > "$out/versions.txt" 2>&1 || true
import importlib, torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
for m in ("fla", "causal_conv1d"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "present"))
    except Exception as e:  # optional kernels: their absence is information, not an error
        print(m, "absent:", type(e).__name__)
PY
cat "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total \
  --format=csv > "$out/gpu.csv" 2>&1 || true
quick=()
if [ "$tokens" != 55664 ]; then
  quick=(--quick "$(python3 -c "print(min(1.0, $tokens / 55664))")")
fi
python3 -m hybridkv.cli bench scenarios/h200_hf_oracle.toml --out "$out/hf_oracle" "${quick[@]}"
# No figures to hold it to yet: an empty baseline leaves the invariants (oracle_pass, corrupt chunks, VRAM)
printf 'scenario = "h200_hf_oracle"\n' > "$out/invariants-only.toml"
python3 -m hybridkv.cli gate "$out/hf_oracle" --baseline "$out/invariants-only.toml" | tee "$out/gate.txt"
