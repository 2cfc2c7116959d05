#!/usr/bin/env bash
# Creates .venv and installs the project: torch first, then everything else.
# Idempotent: a second run only checks that the requirements are met.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.installed-$(sha1sum requirements.txt | cut -c1-12)
# pip, quietly; drops this machine's notes about unreachable local index folders.
pipq() {
  .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
  return "${PIPESTATUS[0]}"
}
if [ ! -f "$stamp" ]; then
  pipq --upgrade pip
  pipq torch==2.13.0            # first: every later range is met by it, so no CUDA build is pulled
  pipq -r requirements.txt
  touch "$stamp"
fi
# The tests' reference implementations (verl's losses), without their trainers' dependencies (ray, vllm, ...).
oracle=.venv/.oracle-$(sha1sum requirements-oracle.txt | cut -c1-12)
if [ ! -f "$oracle" ]; then
  pipq --no-deps -r requirements-oracle.txt
  touch "$oracle"
fi
# `train` as a package of this folder (editable) and the infinite-rl-plot command; the requirements
# above are its dependencies already (pyproject.toml lists the same): pip fetches only setuptools to build it.
[ -x .venv/bin/infinite-rl-plot ] || PYTHONWARNINGS=ignore pipq --no-deps -e .  # ignore: setuptools' notes on editable installs
if [ "${INSTALL_BENCH:-0}" = 1 ]; then pipq -r requirements-bench.txt; fi
# tinker-cookbook for benchmarks/tinker_cookbook_*.py (docs/tinker.md): its own requirements, then it without them.
if [ "${INSTALL_COOKBOOK:-0}" = 1 ]; then pipq -r requirements-cookbook.txt && pipq --no-deps tinker-cookbook==0.6.1; fi
