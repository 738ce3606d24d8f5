#!/usr/bin/env bash
# Stage 17 of issue #30: the shipped backbone trained 500 more steps on the answer store with the target's own chat
# requests added (source magpie: 5,313 greedy answers to requests it wrote, shards 41-53 of data/answers, once an
# epoch) beside stage 15's mix; stage 16 (`../stage16/`) showed that more passes over the old answers no longer move
# the drafter. Then the mean weighted 2:1 towards it against the shipped one, and the adapters on it from the shipped
# ones (scripts/stage_adapters.sh, the same mix). The verdict's shipped side is stage 15's own verdict reports of the
# same (still shipped) drafters, copied. Rerun to resume: training resumes from its last save, or is skipped once its
# backbone is kept in data/stages; an evaluation whose report exists is skipped. Then, with METHODS
# dflash@16,ddtree@16,dflash@4,ddtree@4,treeflash@16,treeflash@4,tfm@16,tfm@4:
# python scripts/ship_if_better.py --domains runs/s17 METHODS
#
#   nohup bash docs/results/training/stage17/stage17.sh > runs/s17/stage17.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s17 TF=.venv/bin/treeflash S=data/stages/smollm2-135m-instruct
SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct
REPEAT=sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2
mkdir -p $R/eval
../shared/tools/machine-facts.sh > $R/machine.txt
for f in docs/results/training/stage15/cmp/eval/new-*.json; do
    cp -n "$f" "$R/eval/shipped-${f##*/new-}"
done

B=${S}-dflash-stage17
if [ ! -d $B ]; then
    $TF train dflash --init ${SHIPPED}-dflash --out $R/dflash --steps 500 --lr 1.5e-4 --seed 17 --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every 250 --log-every 10 --short-blocks 0.5 --threads 2 --repeat $REPEAT
    cp -r $R/dflash/drafter $B.tmp && mv $B.tmp $B
fi
$TF train average ${SHIPPED}-dflash $B --weights 1,2 --out $R/w12/drafter

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $R/w12/drafter"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage 17's backbone done: python scripts/ship_if_better.py --domains $R dflash@16,ddtree@16,dflash@4,ddtree@4"

bash scripts/stage_adapters.sh $R/w12/drafter $R $REPEAT 18 21 400 160
echo "stage 17 done: python scripts/ship_if_better.py --domains $R METHODS"
