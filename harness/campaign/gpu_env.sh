# Source this on a GPU machine that has CUDA torch but no network (e.g. the H200 box), from the repository
# root: installs the carried wheels in .whl/ (msgspec, pyzmq, isal for the L2 checksum; fla for the transformers engine) into
# /tmp/site and the project itself (editable, no dependencies, so the machine's own torch stays), which
# also registers the harness's `hybridkv` subcommands.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/hybridkv-install.log 2>&1 \
  || { echo "editable install failed; see /tmp/hybridkv-install.log" >&2; cat /tmp/hybridkv-install.log >&2; return 1; }
python3 -c "import hybridkv, hybridkv_bench, msgspec, zmq, torch; print('hybridkv env: torch', torch.__version__, 'cuda', torch.cuda.is_available())"
