#!/usr/bin/env bash
# EAGLE, FastEagle and Falcon drafters trained at once on one GPU, each for about MINUTES, from a make-data folder:
# the run that made the GPU-trained drafters of docs/drafters.md ("Training on a GPU").
#
#   bash scripts/train_drafters_gpu.sh MODEL DATA_DIR WORK_DIR [MINUTES]
#
# MODEL: the target (a .gguf file, an HF folder or an alias); DATA_DIR: a `fastforward make-data` folder (its stored
# features are not read: on a GPU the trainers compute the target's features there, per batch); WORK_DIR: one
# folder per drafter, plus a probe folder each. First each trainer runs PROBE_STEPS steps to time its step with the
# other two beside it; then each trains for the epochs that fit MINUTES at that pace (a full learning-rate schedule;
# `--max-minutes` stops it if the pace was misjudged). Environment: BATCH (16), LR (5e-4), PROBE_STEPS (16), THREADS
# (4 per trainer). It runs anywhere the trainers run (on a CPU, slowly).
set -euo pipefail
model=${1:?usage: train_drafters_gpu.sh MODEL DATA_DIR WORK_DIR [MINUTES]}
data=${2:?usage: train_drafters_gpu.sh MODEL DATA_DIR WORK_DIR [MINUTES]}
work=${3:?usage: train_drafters_gpu.sh MODEL DATA_DIR WORK_DIR [MINUTES]}
minutes=${4:-5}
batch=${BATCH:-16}
lr=${LR:-5e-4}
probe_steps=${PROBE_STEPS:-16}
threads=${THREADS:-4}
methods="eagle fasteagle falcon"
mkdir -p "$work"
common=(--model "$model" --data "$data" --batch-size "$batch" --grad-accum 1 --lr "$lr" --mixed-precision bf16
        --threads "$threads" --quiet)

for m in $methods; do
  fastforward train "$m" "${common[@]}" --out "$work/probe-$m" --max-steps "$probe_steps" --eval-records 0 \
    --save-every 100000 >"$work/probe-$m.log" 2>&1 &
done
wait

epochs_for() {  # epochs_for METHOD: the epochs that fit MINUTES at the probe's pace (0.92 of it, 0.5 to 10)
  python3 - "$work/probe-$1" "$minutes" "$batch" <<'PY'
import json, math, sys
probe, minutes, batch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
log = [json.loads(line) for line in open(f"{probe}/train_log.jsonl")]
per_step = sum(r["seconds"] for r in log[3:]) / max(1, len(log[3:]))  # each step's own seconds, after 3 warm-up
steps = math.ceil(json.load(open(f"{probe}/fastforward_train.json"))["sequences"] / batch)
print(f"{max(0.5, min(10.0, 0.92 * minutes * 60 / (per_step * steps))):.2f}")
PY
}

for m in $methods; do
  epochs=$(epochs_for "$m")
  echo "$m: $epochs epochs"
  fastforward train "$m" "${common[@]}" --out "$work/$m" --epochs "$epochs" --max-minutes "$minutes" \
    --save-every 100000 >"$work/$m.log" 2>&1 &
done
wait
for m in $methods; do tail -n 2 "$work/$m.log"; done
