#!/usr/bin/env bash
# Stage 14 of issue #30: the mean of stages 12 and 13's backbones (`treeflash train average`), its evaluations,
# then the adapters from stage 12's on it and theirs. Rerun to resume: an evaluation whose report exists is
# skipped, an adapter's training resumes from its last save.
#
#   nohup bash docs/results/training/stage14/stage14.sh > runs/s14/stage14.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s14 TF=.venv/bin/treeflash S=data/stages/smollm2-135m-instruct
REPEAT=sharegpt@0=3,gsm8k@0=2,code_alpaca@0=2,mbpp@0=2  # stage 13's mix
mkdir -p $R/eval
../shared/tools/machine-facts.sh > $R/machine.txt

B=$R/dflash/drafter
$TF train average ${S}-dflash-stage12 ${S}-dflash-stage13 --out $B

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $B"
done | bash scripts/paired_jobs.sh 2 16,4

adapter() {  # adapter KIND STEPS SEED INIT: the adapters from stage 12's, one thread each, side by side
    OMP_NUM_THREADS=1 $TF train "$1" --backbone $B ${5:-} --init "$4" --out $R/"$1" --steps "$2" \
        --lr 3e-4 --seed "$3" --batch-size 4 --max-len 512 --num-anchors 64 --save-every 25 --log-every 10 \
        --threads 1 --repeat $REPEAT > $R/"$1".log 2>&1
}
adapter treeflash 500 15 ${S}-treeflash-stage12 --freeze-backbone &
adapter weaver 200 18 ${S}-weaver-stage12 &
wait

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d-treeflash.json --dataset $d --methods treeflash --drafter $R/treeflash/drafter"
    echo "$R/eval/new-$d-tfm.json --dataset $d --methods tfm --drafter $B --weaver $R/weaver/weaver"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage 14 done"
