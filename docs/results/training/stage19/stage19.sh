#!/usr/bin/env bash
# Stage 19 of issue #30, the capacity A/B: stage 17 again (`../stage17/`: 500 steps from the shipped backbone, the
# same store, mix, seed 17 and lr 1.5e-4, so the same answers in the same order) with a fourth draft layer, grown
# on top of the shipped three as the identity (`train dflash --add-layers 1`). Stage 17's trained backbone is the A
# arm. A four-layer drafter cannot be averaged with a three-layer one, so both arms are judged as trained, with the
# stage rule: runs/s19/ab (four layers against stage 17's three), runs/s19 (four layers against the shipped drafters).
# Needs stage 17's backbone in runs/s17/backbone (docs/results/training/stage17/stage17.sh makes it again).
#
#   nohup bash docs/results/training/stage19/stage19.sh > runs/s19/stage19.log 2>&1 &
#   python scripts/ship_if_better.py --domains runs/s19/ab dflash@16,ddtree@16,dflash@4,ddtree@4
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s19 TF=${TF:-.venv/bin/treeflash} SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct-dflash
THREE=runs/s17/backbone
mkdir -p $R/eval $R/ab/eval runs/s17/raw/eval
../shared/tools/machine-facts.sh > $R/machine.txt
[ -d $THREE ] || { echo "no $THREE: run docs/results/training/stage17/stage17.sh first" >&2; exit 1; }
[ -d $R/dflash/drafter-step000500 ] ||
    $TF train dflash --init $SHIPPED --add-layers 1 --out $R/dflash --steps 500 --lr 1.5e-4 --seed 17 --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every 250 --log-every 10 --short-blocks 0.5 --threads 2 \
        --repeat sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $R/dflash/drafter"
    echo "runs/s17/raw/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $THREE"
done | bash scripts/paired_jobs.sh 2 16,4
for d in chat-dev gsm8k humaneval mbpp; do
    cp -n docs/results/training/stage15/cmp/eval/new-$d.json $R/eval/shipped-$d.json
    cp -n $R/eval/new-$d.json $R/ab/eval/new-$d.json
    cp -n runs/s17/raw/eval/new-$d.json $R/ab/eval/shipped-$d.json
done
echo "stage 19 done: python scripts/ship_if_better.py --domains $R/ab dflash@16,ddtree@16,dflash@4,ddtree@4"
