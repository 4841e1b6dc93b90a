#!/bin/bash
# Old and new trees' PageCodec.read_cache on the CPU, alternated in one run:  bash ab.sh OLD NEW OUT_DIR [passes]
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/../alternate.sh" "$1" "$2" "$3/read_cache.jsonl" "${4:-3}" ${PY:-/work/main/.nox/shared/bin/python} \
  "$here/read_cache.py"
