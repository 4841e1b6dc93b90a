#!/bin/bash
# The quiet window: nothing else runs. TTFT both modes, the compare trio, lookup p50 old/new alternated.
Q=/tmp/quiet; cd /work/main
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
m() { echo "$1 $(date -u +%T) $(uptime)" >> $Q/marks.log; }
m "start mp"; .nox/vllm_engine/bin/hybridkv vllm-ttft --out $Q/ttft-mp scenarios/vllm_real/ttft_cpu_8k16k.toml > $Q/ttft-mp.log 2>&1; m "end mp rc=$?"
m "start ip"; VLLM_ENABLE_V1_MULTIPROCESSING=0 .nox/vllm_engine/bin/hybridkv vllm-ttft --out $Q/ttft-ip scenarios/vllm_real/ttft_cpu_8k16k.toml > $Q/ttft-ip.log 2>&1; m "end ip rc=$?"
H=.nox/shared/bin/hybridkv
m "start compare"
$H bench scenarios/compare_cpu.toml --out $Q/cmp/a --no-report > $Q/cmp-a.log 2>&1; m "a rc=$?"
$H bench scenarios/compare_cpu.toml --out $Q/cmp/b --no-report > $Q/cmp-b.log 2>&1; m "b rc=$?"
$H bench scenarios/compare_cpu.toml --out $Q/cmp/slow --no-report --planted-slowdown 0.25 > $Q/cmp-slow.log 2>&1; m "slow rc=$?"
$H report --compare $Q/cmp/a $Q/cmp/b --out $Q/cmp/compare-a-b > $Q/cmp-ab.log 2>&1; m "cmp ab rc=$?"
$H report --compare $Q/cmp/a $Q/cmp/slow --out $Q/cmp/compare-a-slow > $Q/cmp-aslow.log 2>&1; m "cmp aslow rc=$?"
# lookup_new.py: ../reshape/lookup_p50.py with its import "from hybridkv.wire import protocol as P" (the new tree)
m "start lookup"
for i in 1 2 3; do
  echo "old $i $(PYTHONPATH=/tmp/q-old/reference_impl:/tmp/q-old/kernels:/tmp/q-old/harness .nox/shared/bin/python $Q/lookup_old.py --rounds 400 --json)" >> $Q/lookup.txt
  echo "new $i $(.nox/shared/bin/python $Q/lookup_new.py --rounds 400 --json)" >> $Q/lookup.txt
done
m "end lookup"
