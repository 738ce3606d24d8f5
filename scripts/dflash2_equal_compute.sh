#!/usr/bin/env bash
# Issue 31's table at equal training compute: DFlash2 against DFlash, both going on from the shipped DFlash drafter
# for the same steps on the same sequences (data, seed, anchors, learning rate and schedule equal):
#   arm dflash:  `train dflash --init` the shipped drafter (a fresh optimiser);
#   arm dflash2: `train dflash2 --backbone` the shipped drafter (its weights, the convs the identity, a fresh selector).
# The two train side by side on one thread each (their CPU seconds are in each log.jsonl); then tau per domain with
# `paired` (fp32, 10 prompts, 128 tokens, B = 16) at T = 0 and T = 1 (E[tau]): each arm's methods, and the shipped
# drafters' dflash, ddtree, treeflash and tfm. A rerun skips what exists.
#
#   bash scripts/dflash2_equal_compute.sh [STEPS] [RUN_DIR]     # defaults: 100 runs/eq
set -euo pipefail
cd "$(dirname "$0")/.."

TF=.venv/bin/treeflash
steps=${1:-100}
run=${2:-runs/eq}
shipped=src/treeflash/checkpoints/smollm2-135m-instruct-dflash
common=(--steps "$steps" --lr 3e-4 --seed 3 --batch-size 4 --max-len 512 --save-every 25 --log-every 5 --threads 1)
mkdir -p "$run/eval"
bash ../shared/tools/machine-facts.sh > "$run/machine.txt" 2>/dev/null || true

echo "== training, $steps steps each, side by side"
OMP_NUM_THREADS=1 $TF train dflash --init "$shipped" --out "$run/dflash" "${common[@]}" > "$run/dflash.log" 2>&1 &
OMP_NUM_THREADS=1 $TF train dflash2 --backbone "$shipped" --out "$run/dflash2" "${common[@]}" > "$run/dflash2.log" 2>&1 &
wait -n && wait -n  # both must succeed

paired() {  # paired OUT ARGS...: one thread (two run side by side; tau does not depend on the clock)
    local out=$1; shift
    [ -f "$out" ] || OMP_NUM_THREADS=1 $TF paired --limit 10 --max-new-tokens 128 --budget 16 --no-progress "$@" \
        --out "$out.tmp" > "$out.log" 2>&1
    [ -f "$out" ] || mv "$out.tmp" "$out"
}
export -f paired
export TF
echo "== tau per domain and temperature, two at a time"
for t in 0 1; do
    for dataset in chat-dev gsm8k humaneval mbpp; do
        args="--dataset $dataset --temperature $t"
        echo "$run/eval/dflash2-$dataset-T$t.json $args --methods dflash2,dflash2-tree --drafter $run/dflash2/drafter"
        echo "$run/eval/dflash-$dataset-T$t.json $args --methods dflash,ddtree --drafter $run/dflash/drafter"
        echo "$run/eval/shipped-$dataset-T$t.json $args --methods dflash,ddtree,treeflash,tfm"
    done
done | xargs -P 2 -L 1 bash -c 'paired "$@"' _
echo "== done: $run/eval"
