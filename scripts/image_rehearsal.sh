#!/usr/bin/env bash
# The lent GPU's software on this CPU machine, before a GPU run: a venv with the device image's torch and
# transformers (2.11.0 and 5.17.0; this project's CPU machines run 2.13 and the newest transformers), then
# the unit tests and `benchmarks/gpu_suite.py --tiny` in it, so a break that only those versions show is
# found here, not in the GPU's 15 minutes (the H100 run of 2026-11-27 lost its first call to one).
#
#   bash scripts/image_rehearsal.sh                    # venv in /tmp/image_venv (~5 GB, ~5 min once), ~4 min
#   bash scripts/image_rehearsal.sh VENV suite         # the whole suite instead of the unit tests (~26 min)
#   PYTHON=python3.12 bash scripts/image_rehearsal.sh  # the image's Python too
#
# PyPI's torch 2.11.0 for Linux is the CUDA build (with its NVIDIA libraries, ~3 GB): the image's own build,
# run on the CPU. Such a build without a GPU has one fault of its own, which a GPU does not have: the first
# trace by dynamo in a worker thread (the hf engine compiles in its thread) swaps in a no-op CUDA device guard
# there, and a later backward or trace in the main thread segfaults. The venv's sitecustomize.py
# (scripts/rehearsal_sitecustomize.py) does that swap in the main thread first, in every Python process of the
# venv, so the rehearsal runs what the GPU runs.
set -euo pipefail
cd "$(dirname "$0")/.."
USAGE="usage: bash scripts/image_rehearsal.sh [VENV] [unit|suite]"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0;; esac
VENV=${1:-/tmp/image_venv}
WHAT=${2:-unit}
TORCH=${IMAGE_TORCH:-2.11.0}
TRANSFORMERS=${IMAGE_TRANSFORMERS:-5.17.0}
# The project's own install (scripts/install.sh) into VENV, with the image's versions pinned through it.
VENV="$VENV" TORCH_VERSION="$TORCH" TRANSFORMERS_VERSION="$TRANSFORMERS" INSTALL_BENCH=1 bash scripts/install.sh
cp scripts/rehearsal_sitecustomize.py \
  "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sitecustomize.py"
"$VENV/bin/python" -c "import sys, torch, transformers; print('rehearsal: Python', sys.version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__)"
STATUS=0
if [ "$WHAT" = suite ]; then
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider || STATUS=$?
else
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit || STATUS=$?
fi
OUT=$(mktemp -d)
"$VENV/bin/python" benchmarks/gpu_suite.py --tiny --out "$OUT" > "$OUT/gpu_suite.log" 2>&1 || STATUS=$?
if [ -f "$OUT/gpu_suite.md" ]; then grep "^| " "$OUT/gpu_suite.md"; fi
grep -E "^\[gpu_suite\] failed|Fatal Python error" "$OUT/gpu_suite.log" || true
echo "image_rehearsal: exit $STATUS (tests and gpu_suite --tiny on torch $TORCH, transformers $TRANSFORMERS; log $OUT)"
exit "$STATUS"
