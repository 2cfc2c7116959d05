#!/usr/bin/env bash
# Creates .venv and installs the project: torch first, then everything else.
# Idempotent: a second run only checks that the requirements are met.
#
# Other versions, in another venv (scripts/image_rehearsal.sh does this with the GPU image's versions):
#   VENV=/tmp/v TORCH_VERSION=2.11.0 TRANSFORMERS_VERSION=5.17.0 bash scripts/install.sh
# TORCH_VERSION replaces requirements.txt's torch pin, TRANSFORMERS_VERSION its transformers range; both
# hold through every later install (the benchmarks' trl included), so no step moves them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH_VERSION:-$(sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements.txt)}
TRANSFORMERS=${TRANSFORMERS_VERSION:-}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# requirements.txt with the versions asked for (unchanged by default); pins hold them in every install below.
reqs="$VENV/requirements.txt"
sed -e "s/^torch==[^ ]*/torch==$TORCH/" ${TRANSFORMERS:+-e "s/^transformers>=[^ ]*/transformers==$TRANSFORMERS/"} \
  requirements.txt > "$reqs"
pins=("torch==$TORCH" ${TRANSFORMERS:+"transformers==$TRANSFORMERS"})
# pip, quietly; drops this machine's notes about unreachable local index folders.
pipq() {
  "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
  return "${PIPESTATUS[0]}"
}
# Each step once per content of what it installs (a stamp file in the venv).
stamp() { echo "$VENV/.$1-$(cat "${@:2}" | sha1sum | cut -c1-12)"; }
done_=$(stamp installed "$reqs")
if [ ! -f "$done_" ]; then
  pipq --upgrade pip
  pipq "${pins[@]}"             # first: every later range is met by it, so no CUDA build is pulled
  pipq -r "$reqs" "${pins[@]}"
  touch "$done_"
fi
# The tests' reference implementations (verl's losses), without their trainers' dependencies (ray, vllm, ...).
done_=$(stamp oracle requirements-oracle.txt)
if [ ! -f "$done_" ]; then
  pipq --no-deps -r requirements-oracle.txt
  touch "$done_"
fi
# `train` as a package of this folder (editable) and the infinite-rl-plot command; the requirements
# above are its dependencies already (pyproject.toml lists the same): pip fetches only setuptools to build it.
[ -x "$VENV/bin/infinite-rl-plot" ] || PYTHONWARNINGS=ignore pipq --no-deps -e .  # ignore: setuptools' notes on editable installs
if [ "${INSTALL_BENCH:-0}" = 1 ]; then
  done_=$(stamp bench requirements-bench.txt "$reqs")
  [ -f "$done_" ] || { pipq -r requirements-bench.txt "${pins[@]}" && touch "$done_"; }
fi
# tinker-cookbook for benchmarks/tinker_cookbook_*.py (docs/tinker.md): its own requirements, then it without them.
if [ "${INSTALL_COOKBOOK:-0}" = 1 ]; then pipq -r requirements-cookbook.txt "${pins[@]}" && pipq --no-deps tinker-cookbook==0.6.1; fi
