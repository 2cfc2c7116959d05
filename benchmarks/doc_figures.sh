#!/usr/bin/env bash
# Re-measure the figures a newcomer meets in the README and docs, one command after the other on
# this machine, so they can be compared with a fresh run of the current main:
#
#     bash benchmarks/doc_figures.sh [OUT_DIR]        # default runs/doc_figures; ~15 min on 2 cores
#
# Each command's output goes to OUT_DIR/<name>.log and its wall time to OUT_DIR/times.tsv. Run it on
# an idle machine: the figures are seconds. SMOLLM2=0 skips the SmolLM2-135M comparison (~6 min).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/doc_figures}
mkdir -p "$out"
: > "$out/times.tsv"
py=.venv/bin/python

measure() {  # measure NAME COMMAND...: run it, log it, record its wall seconds and exit status
  local name=$1; shift
  local start end status
  echo "== $name: $*"
  start=$(date +%s.%N)
  "$@" > "$out/$name.log" 2>&1
  status=$?
  end=$(date +%s.%N)
  awk -v n="$name" -v s="$start" -v e="$end" -v r="$status" -v c="$*" 'BEGIN { printf "%s\t%.1f\t%s\t%s\n", n, e - s, r, c }' | tee -a "$out/times.tsv"
  tail -n 12 "$out/$name.log"
}

date -u +"measured %Y-%m-%d %H:%M UTC on $(nproc) cores" | tee "$out/when.txt"
[ -n "$($py -c 'import trl' 2>&1)" ] && .venv/bin/pip install -q -r requirements-bench.txt

measure demo .venv/bin/torchrun --standalone --nproc_per_node=2 -m train.trainer.grpo --config-name stub \
    trainer.save_dir="$out/stub" trainer.overwrite=true
measure vs_trl $py benchmarks/vs_trl.py
measure warm_model $py stub/data/search/warm_model.py --out "$out/search-tiny"
measure hf_engine_throughput $py benchmarks/hf_engine_throughput.py --model stub/model --device cpu --threads 1
measure streaming_reward $py benchmarks/streaming_reward.py --threads 1
if [ "${SMOLLM2:-1}" = 1 ]; then
  measure prepare_smollm2 $py scripts/prepare_smollm2.py
  measure vs_trl_smollm2 $py benchmarks/vs_trl.py --model .cache/smollm2-135m-instruct --steps 5 --warmup 1 \
      --prompts 4 --responses 4 --max-new-tokens 32
fi
echo "times: $out/times.tsv"
