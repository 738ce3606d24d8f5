#!/usr/bin/env bash
# Issue 31's table at equal training compute: DFlash2 against DFlash, both going on from the shipped DFlash drafter
# for about the same CPU seconds on the same data (seed, anchors, peak learning rate and schedule shape equal). A
# DFlash2 step costs ~5x a DFlash one (its loss is over the whole vocabulary: it scores every token, where DFlash
# learns on its 4,096 FR-Spec rows), so it gets ~1/5 of the steps:
#   arm dflash:  `train dflash --init` the shipped drafter (a fresh optimiser);
#   arm dflash2: `train dflash2 --backbone` the shipped drafter (its weights, the convs the identity, a fresh selector).
# The two train side by side on one thread each (their CPU seconds are in each log.jsonl); then tau per domain with
# `paired` (fp32, 10 prompts, 128 tokens, B = 16) at T = 0 and T = 1 (E[tau]): each arm's methods, and the shipped
# drafters' dflash, ddtree, treeflash and tfm. A rerun skips what exists.
#
#   bash scripts/dflash2_equal_compute.sh [DFLASH_STEPS] [DFLASH2_STEPS] [RUN_DIR]     # defaults: 100 20 runs/eq
set -euo pipefail
cd "$(dirname "$0")/.."

TF=.venv/bin/treeflash
steps=${1:-100}
steps2=${2:-20}
run=${3:-runs/eq}
shipped=src/treeflash/checkpoints/smollm2-135m-instruct-dflash
common=(--lr 3e-4 --seed 3 --batch-size 4 --max-len 512 --save-every 25 --log-every 5 --threads 1)
mkdir -p "$run/eval"
bash ../shared/tools/machine-facts.sh > "$run/machine.txt" 2>/dev/null || true

echo "== training side by side: DFlash $steps steps, DFlash2 $steps2"
OMP_NUM_THREADS=1 $TF train dflash --init "$shipped" --out "$run/dflash" --steps "$steps" "${common[@]}" \
    > "$run/dflash.log" 2>&1 &
OMP_NUM_THREADS=1 $TF train dflash2 --backbone "$shipped" --out "$run/dflash2" --steps "$steps2" "${common[@]}" \
    > "$run/dflash2.log" 2>&1 &
wait -n && wait -n  # both must succeed

echo "== tau per domain and temperature, two at a time"
for t in 0 1; do
    for dataset in chat-dev gsm8k humaneval mbpp; do
        args="--dataset $dataset --temperature $t"
        echo "$run/eval/dflash2-$dataset-T$t.json $args --methods dflash2,dflash2-tree --drafter $run/dflash2/drafter"
        echo "$run/eval/dflash-$dataset-T$t.json $args --methods dflash,ddtree --drafter $run/dflash/drafter"
        echo "$run/eval/shipped-$dataset-T$t.json $args --methods dflash,ddtree,treeflash,tfm"
    done
done | bash scripts/paired_jobs.sh 2 16
echo "== done: $run/eval"
