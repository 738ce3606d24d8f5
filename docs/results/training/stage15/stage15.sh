#!/usr/bin/env bash
# Stage 15 of issue #30: the shipped stage-14 backbone (the mean of stages 12 and 13) trained 500 more steps, chat's
# and Code Alpaca's greedy answers weighted up once more (chat-dev and HumanEval are the domains short of their
# targets); then three candidates, the trained backbone, its mean with stage 14's and a mean weighted 2:1 towards
# it, each evaluated against the shipped drafters; then the adapters on the best of them (the weighted mean: it
# loses one cell of 16, the others two or more), from the shipped adapters (scripts/stage_adapters.sh). Rerun to
# resume: training resumes from its last save, or is skipped once its backbone is kept in data/stages (commit that
# folder: it cost CPU hours); an evaluation whose report exists is skipped.
#
#   nohup bash docs/results/training/stage15/stage15.sh > runs/s15/stage15.log 2>&1 &
#
# It reads the shipped stage-14 drafters and the kept stage-15 backbone: since stage 15 shipped, rerun it at commit
# 03bb6ec (e.g. in `git worktree add ../s15 03bb6ec`), where both are as it found them.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s15 TF=.venv/bin/treeflash S=data/stages/smollm2-135m-instruct
SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct
REPEAT=sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2
mkdir -p $R/eval
../shared/tools/machine-facts.sh > $R/machine.txt

B=${S}-dflash-stage15
if [ ! -d $B ]; then
    $TF train dflash --init ${SHIPPED}-dflash --out $R/dflash --steps 500 --lr 1.5e-4 --seed 15 --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every 250 --log-every 10 --short-blocks 0.5 --threads 2 --repeat $REPEAT
    cp -r $R/dflash/drafter $B.tmp && mv $B.tmp $B
fi
$TF train average ${SHIPPED}-dflash $B --out $R/mean/drafter
$TF train average ${SHIPPED}-dflash $B --weights 1,2 --out $R/w12/drafter

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $B"
    echo "$R/eval/mean-$d.json --dataset $d --methods dflash,ddtree --drafter $R/mean/drafter"
    echo "$R/eval/w12-$d.json --dataset $d --methods dflash,ddtree --drafter $R/w12/drafter"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage 15's backbones done: compare eval/{new,mean,w12}-D.json with ../stage14/eval/new-D.json"

bash scripts/stage_adapters.sh $R/w12/drafter $R $REPEAT 16 19
echo "stage 15's adapters done: compare eval/new-D-{treeflash,tfm}.json with ../stage14/eval/new-D-{treeflash,tfm}.json"

# The verdict's evaluations again, now with each prompt's sums (for scripts/ship_if_better.py's bootstrap), into
# $R/cmp/eval in its layout: stage 15's drafters (new-*) against the shipped stage-14 ones (shipped-*; run this
# before stage 15 is shipped). At T = 0 each report's E[tau] equals the earlier one's.
C=$R/cmp/eval
mkdir -p $C
for d in chat-dev gsm8k humaneval mbpp; do
    echo "$C/shipped-$d.json --dataset $d --methods dflash,ddtree --drafter ${SHIPPED}-dflash"
    echo "$C/new-$d.json --dataset $d --methods dflash,ddtree --drafter $R/w12/drafter"
    echo "$C/shipped-$d-treeflash.json --dataset $d --methods treeflash --drafter ${SHIPPED}-treeflash"
    echo "$C/new-$d-treeflash.json --dataset $d --methods treeflash --drafter $R/treeflash/drafter"
    echo "$C/shipped-$d-tfm.json --dataset $d --methods tfm --drafter ${SHIPPED}-dflash --weaver ${SHIPPED}-weaver"
    echo "$C/new-$d-tfm.json --dataset $d --methods tfm --drafter $R/w12/drafter --weaver $R/weaver/weaver"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage 15 done: python scripts/ship_if_better.py $R/cmp METHODS"
