#!/usr/bin/env bash
# Stage 20 of issue #30, the loss-weight A/B: stage 17 again (`../stage17/`: 500 steps from the shipped backbone,
# the same store, mix, seed 17 and lr 1.5e-4, so the same answers, anchors and block lengths in the same order) with
# the block's positions weighted exp(-(k - 1) / 3.5) instead of exp(-(k - 1) / 7) (`--loss-decay 3.5`): the trees
# verified on a CPU are small, so their first positions are what pays. Stage 17's backbone as trained is the A arm
# (its reports in runs/s17/raw/eval, which stage19.sh makes); both are judged as trained, with the stage rule:
#
#   nohup bash docs/results/training/stage20/stage20.sh > runs/s20/stage20.log 2>&1 &
#   python scripts/ship_if_better.py --domains runs/s20/ab dflash@16,ddtree@16,dflash@4,ddtree@4
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s20 TF=${TF:-.venv/bin/treeflash} SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct-dflash
mkdir -p $R/ab/eval runs/s17/raw/eval
../shared/tools/machine-facts.sh > $R/machine.txt
[ -d $R/dflash/drafter-step000500 ] ||
    $TF train dflash --init $SHIPPED --loss-decay 3.5 --out $R/dflash --steps 500 --lr 1.5e-4 --seed 17 --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every 250 --log-every 10 --short-blocks 0.5 --threads 2 \
        --repeat sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/ab/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $R/dflash/drafter"
    echo "runs/s17/raw/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter runs/s17/backbone"
done | bash scripts/paired_jobs.sh 2 16,4
for d in chat-dev gsm8k humaneval mbpp; do
    cp -n runs/s17/raw/eval/new-$d.json $R/ab/eval/shipped-$d.json
done
echo "stage 20 done: python scripts/ship_if_better.py --domains $R/ab dflash@16,ddtree@16,dflash@4,ddtree@4"
