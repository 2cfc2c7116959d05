#!/usr/bin/env bash
# The wheels the trainer needs beyond a CUDA PyTorch image (torch, transformers, safetensors,
# tokenizers, numpy, pandas, pyarrow, pyyaml, tqdm, matplotlib already there), for a GPU node
# with no package index. Run it where pip can reach an index; copy DIR to the node; install there.
#
#   bash scripts/offline_wheels.sh DIR [PYTHON_VERSION] [--bench] # default Python 3.12, x86_64 Linux
#   python3 -m pip install --no-index --no-deps DIR/*.whl         # on the GPU node
#
# ~3 MB. liger-kernel (actor.use_liger_kernel) is included; SGLang is not (requirements-gpu.txt).
# --bench adds the peer of benchmarks/vs_trl.py (`gpu_suite.py --only trl`): trl and what it needs
# beyond the image and the list below (accelerate, psutil, xxhash): 4.3 MB in all (14 wheels, 2026-11-29).
set -euo pipefail
USAGE="usage: bash scripts/offline_wheels.sh DIR [PYTHON_VERSION] [--bench]"
BENCH=0
ARGS=()
for a in "$@"; do
  case "$a" in
    -h|--help) echo "$USAGE"; exit 0;;
    --bench) BENCH=1;;
    -*) echo "$USAGE" >&2; exit 2;;  # not a folder named --help
    *) ARGS+=("$a");;
  esac
done
DIR=${ARGS[0]:?"$USAGE"}
PYV=${ARGS[1]:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
# DIR holds this script's wheels only: last time's go first, so that a newer release of one of them does not
# leave two versions side by side (which stops the offline install).
rm -f "$DIR"/*.whl
# Each name exactly once (two versions of one package stop an offline install); --no-deps, so
# their own needs are listed too where the image lacks them.
PKGS=(
  "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4"        # config (antlr4 below)
  "torchdata>=0.11"                                    # the stateful dataloader
  "math-verify>=0.7" "latex2sympy2_extended>=1.0"      # math rewards
  "datasets>=3.0" "dill>=0.3" "multiprocess>=0.70"     # split@repo data sources
  "liger-kernel>=0.5"                                  # fused log-prob head on GPU (optional)
)
if [ "$BENCH" = 1 ]; then
  PKGS+=("trl>=0.20" "accelerate>=1.10" "psutil>=5.9" "xxhash>=3.0")
fi
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$PYV" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${PKGS[@]}"
# hydra-core and omegaconf need antlr4-python3-runtime 4.9.*, published only as a source archive:
# build its pure-Python wheel here.
"$PY" -m pip wheel -q --no-deps -w "$DIR" "antlr4-python3-runtime==4.9.3"
echo "wheels in $DIR ($(du -sh "$DIR" | cut -f1)):"
ls -1 "$DIR"
echo "on the GPU node: python3 -m pip install --no-index --no-deps $DIR/*.whl"
