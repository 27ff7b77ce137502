#!/usr/bin/env bash
# The drafters of the default model, from data to trained folders, as this project makes them on a 2-core CPU.
# Every step resumes where it stopped (make-data skips the prompts it has answered, each training continues from
# its last checkpoint), so the script is re-run, as it is, after an interruption or in a later session; a step
# already finished is a no-op. Steps run one after another: each needs both cores. On a machine with a GPU the
# training steps run there unchanged (the target's features computed there); scripts/train_drafters_gpu.sh trains
# the three feature drafters at once on one GPU instead.
#
#   bash scripts/drafters_pipeline.sh DATA_DIR WORK_DIR [MINUTES]
#
# DATA_DIR: the make-data folder (about 25 GB with features); WORK_DIR: one folder per drafter; MINUTES: the
# training budget of each drafter per run (default 150). Logs go to WORK_DIR/*.log.
set -euo pipefail
data=${1:?usage: drafters_pipeline.sh DATA_DIR WORK_DIR [MINUTES]}
work=${2:?usage: drafters_pipeline.sh DATA_DIR WORK_DIR [MINUTES]}
minutes=${3:-150}
mkdir -p "$work"
shared=${FASTFORWARD_DATA:?set FASTFORWARD_DATA to the shared data folder}

step() {  # step NAME COMMAND...: run it, its output appended to WORK_DIR/NAME.log
  local name=$1
  shift
  echo "== $(date -u +%FT%TZ) $name: $*" | tee -a "$work/$name.log"
  "$@" >>"$work/$name.log" 2>&1
}

# 1. The target's greedy responses to every training prompt (13,011 of them), features recorded as they are made.
step make-data fastforward make-data --max-new-tokens 512 --max-active 64 --max-batch-tokens 64 --features \
  --method ar --threads 2 --out "$data"
# 2. One sampled response (T = 1) per chat, instruction and code prompt, beside the greedy ones.
step make-data-sampled fastforward make-data --max-new-tokens 512 --max-active 64 --max-batch-tokens 64 --features \
  --method ar --threads 2 --out "$data" --temperature 1 \
  --data "$shared/sharegpt/ShareGPT_V3_filtered_1000.json,$shared/alpaca/alpaca_en_demo.json,$shared/codealpaca/code_alpaca_2k.json"
# 3. The drafters, each for at most MINUTES per run.
step eagle fastforward train eagle --data "$data" --out "$work/eagle" --draft-vocab 8192 --ttt-steps 3 \
  --epochs 3 --lr 7e-4 --batch-size 4 --grad-accum 2 --save-every 200 --max-minutes "$minutes" --threads 2
step fasteagle fastforward train fasteagle --data "$data" --out "$work/fasteagle" --layers 4 --epochs 2 --lr 1e-3 \
  --save-every 200 --max-minutes "$minutes" --threads 2
step falcon fastforward train falcon --data "$data" --out "$work/falcon" --block-size 2 --csgd off --epochs 3 \
  --lr 1e-3 --save-every 200 --max-minutes "$minutes" --threads 2
step draft-model fastforward train draft-model --data "$data" --out "$work/draft-model" --layers 4 --epochs 1 \
  --draft-vocab 8192 --save-every 100 --max-minutes "$minutes" --threads 2
# 4. Each drafter's held-out agreement by depth, beside the shipped one's.
for kind in eagle fasteagle falcon draft-model; do
  step agreement fastforward eval --task agreement --drafter "$work/$kind" --data "$data" --threads 2
done
