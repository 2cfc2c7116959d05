#!/usr/bin/env bash
# The canonical launch. Every setting is an env var with the stub demo as default; any extra
# arguments are passed to the trainer as Hydra overrides (key=value).
#
#   NPROC=8 MODEL=/models/Qwen2.5-1.5B-Instruct DATA=/data/train.jsonl TEST_DATA=/data/test.jsonl \
#   ENV=environments/orz.py SAVE_DIR=runs/orz ./launch_grpo.sh adv.estimator=reinforce actor.lr=1e-6
#
# Multi-node: NNODES=2 NODE_RANK=0|1 MASTER_ADDR=host0 MASTER_PORT=29500 on each node (in a Kubeflow
# PyTorchJob the operator's PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT and
# PET_NPROC_PER_NODE stand in; on SLURM scripts/slurm/grpo.sbatch sets them).
#
# Before torchrun starts, the config is checked in one process (python -m train.trainer.config
# --check; PREFLIGHT=0 skips it), so a mistake is one `error:` line, not a failure report per rank;
# so is a trainer.save_dir that already holds a run. The launch goes through train.launch: torchrun,
# with a rank's `error:` line as the last line, and exit 143 (130 for Ctrl-C) when a SIGTERM stopped
# the run after its ranks saved: run it again with trainer.load_ckpt_from=latest. DRY_RUN=1 prints
# the launch command instead of running it.
set -euo pipefail
cd "$(dirname "$0")"
NPROC=${NPROC:-${PET_NPROC_PER_NODE:-2}}
NNODES=${NNODES:-${PET_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-}}
MASTER_ADDR=${MASTER_ADDR:-${PET_MASTER_ADDR:-}}
MASTER_PORT=${MASTER_PORT:-${PET_MASTER_PORT:-29500}}
CONFIG=${CONFIG:-stub}
PYTHON_BIN=${PYTHON_BIN:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

overrides=()
[ -n "${MODEL:-}" ] && overrides+=("actor.model_name=$MODEL")
[ -n "${DATA:-}" ] && overrides+=("data.train_data_path=$DATA")
[ -n "${TEST_DATA:-}" ] && overrides+=("data.test_data_path=$TEST_DATA")
[ -n "${ENV:-}" ] && overrides+=("rollout.env_path=$ENV")
overrides+=("trainer.save_dir=${SAVE_DIR:-runs/$CONFIG}")

if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:$MASTER_PORT")
else
  rdzv=(--standalone)
fi
if [ "${PREFLIGHT:-1}" != 0 ]; then
  "$PYTHON_BIN" -m train.trainer.config --check --nproc "$((NPROC * NNODES))" \
    --config-name "$CONFIG" "${overrides[@]}" "$@" >/dev/null
fi
launch=("$PYTHON_BIN" -m train.launch "${rdzv[@]}" --nproc_per_node "$NPROC"
        -m train.trainer.grpo --config-name "$CONFIG" "${overrides[@]}" "$@")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${launch[@]}"
  echo
  exit 0
fi
exec "${launch[@]}"
