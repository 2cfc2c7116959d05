#!/usr/bin/env bash
# The GPU suite in one call on a bare CUDA PyTorch image with no package index (a lent GPU's 15 minutes):
# installs the wheels of scripts/offline_wheels.sh into a scratch folder, runs benchmarks/gpu_suite.py with
# the sections asked for, under a time limit, and leaves gpu_suite.{json,md}, the profiles and the logs in OUT
# (not the run folders, which hold checkpoints).
#
#   bash scripts/offline_wheels.sh .whl 3.12 --bench            # here, where pip reaches an index
#   bash scripts/gpu_check.sh .whl push,decode,tests,trl "$OUT" 330   # there: wheels, sections, out, seconds
set -euo pipefail
USAGE="usage: bash scripts/gpu_check.sh WHEELS_DIR SECTIONS OUT [SECONDS]"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0;; esac
WHEELS=${1:?"$USAGE"}
SECTIONS=${2:?"$USAGE"}
OUT=${3:?"$USAGE"}
SECONDS_LIMIT=${4:-330}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: run scripts/offline_wheels.sh first" >&2; exit 2; }
mkdir -p "$OUT" "$SITE"
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$(pwd)${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1 || true
WORK=$(mktemp -d)
STATUS=0
timeout "$SECONDS_LIMIT" "$PY" benchmarks/gpu_suite.py --only "$SECTIONS" --out "$WORK" > "$OUT/gpu_suite.log" 2>&1 \
  || STATUS=$?
# What it measured, even when a section failed or the time ran out (gpu_suite.json and .md are rewritten after each
# section). The device tool brings back at most 8 files: the two results as they are, the rest (profiles, logs,
# the peers' json) in one archive.
for f in gpu_suite.json gpu_suite.md; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
( cd "$WORK" && find . -maxdepth 1 -type f \( -name '*profile*.txt' -o -name '*.log' -o -name '*.json' \) \
  ! -name gpu_suite.json -print0 | tar czf "$OUT/extras.tgz" --null -T - ) || true
tail -n 30 "$OUT/gpu_suite.log"
[ -f "$OUT/gpu_suite.md" ] && cat "$OUT/gpu_suite.md"
echo "gpu_check: exit $STATUS (124: the ${SECONDS_LIMIT} s limit; 1: a section failed), outputs in $OUT"
exit "$STATUS"
