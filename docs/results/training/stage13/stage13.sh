#!/usr/bin/env bash
# Stage 13 of issue #30: stage 12's backbone, 600 more steps (stage 10's schedule), greedy chat weighted up as in
# stage 12 and GSM8K's greedy answers weighted back up beside it; then the backbone's evaluations, then the
# adapters from stage 12's and their evaluations. Rerun to resume: training resumes from its last save (or is
# skipped once its backbone is in data/stages), an evaluation whose report exists is skipped.
#
#   nohup bash docs/results/training/stage13/stage13.sh > runs/s13/stage13.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s13 TF=.venv/bin/treeflash S=data/stages/smollm2-135m-instruct
REPEAT=sharegpt@0=3,gsm8k@0=2,code_alpaca@0=2,mbpp@0=2
mkdir -p $R/eval
../shared/tools/machine-facts.sh > $R/machine.txt

B=${S}-dflash-stage13  # the backbone, once trained and kept in data/stages (skip its training then)
if [ ! -d $B ]; then
    B=$R/dflash/drafter
    $TF train dflash --init ${S}-dflash-stage12 --out $R/dflash --steps 600 --lr 1.5e-4 --seed 13 --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every 250 --log-every 10 --short-blocks 0.5 --threads 2 --repeat $REPEAT
fi

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $B"
done | bash scripts/paired_jobs.sh 2 16,4

adapter() {  # adapter KIND STEPS SEED INIT: the adapters from stage 12's, one thread each, side by side
    OMP_NUM_THREADS=1 $TF train "$1" --backbone $B ${5:-} --init "$4" --out $R/"$1" --steps "$2" \
        --lr 3e-4 --seed "$3" --batch-size 4 --max-len 512 --num-anchors 64 --save-every 25 --log-every 10 \
        --threads 1 --repeat $REPEAT > $R/"$1".log 2>&1
}
adapter treeflash 500 14 ${S}-treeflash-stage12 --freeze-backbone &
adapter weaver 200 17 ${S}-weaver-stage12 &
wait

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d-treeflash.json --dataset $d --methods treeflash --drafter $R/treeflash/drafter"
    echo "$R/eval/new-$d-tfm.json --dataset $d --methods tfm --drafter $B --weaver $R/weaver/weaver"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage 13 done"
