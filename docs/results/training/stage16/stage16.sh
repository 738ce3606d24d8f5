#!/usr/bin/env bash
# Stage 16 of issue #30: the shipped stage-15 backbone trained 400 more steps on stage 15's mix, then weighted 2:1
# towards it against the shipped one (stage 15's best candidate was that mean); the adapters on it from the shipped
# ones, 400 and 160 steps (scripts/stage_adapters.sh). Shorter than stage 15 so that one session holds the whole
# stage. The verdict's shipped side is stage 15's own verdict reports of the same (now shipped) drafters, copied:
# their weights are the shipped ones bit for bit, and paired is deterministic at T = 0. Rerun to resume: training
# resumes from its last save, or is skipped once its backbone is kept in data/stages; an evaluation whose report
# exists is skipped. Then: python scripts/ship_if_better.py --domains runs/s16 METHODS.
#
#   nohup bash docs/results/training/stage16/stage16.sh > runs/s16/stage16.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
R=runs/s16 TF=.venv/bin/treeflash S=data/stages/smollm2-135m-instruct
SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct
REPEAT=sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2
mkdir -p $R/eval
../shared/tools/machine-facts.sh > $R/machine.txt
for f in docs/results/training/stage15/cmp/eval/new-*.json; do
    cp -n "$f" "$R/eval/shipped-${f##*/new-}"
done

B=${S}-dflash-stage16
if [ ! -d $B ]; then
    $TF train dflash --init ${SHIPPED}-dflash --out $R/dflash --steps 400 --lr 1.5e-4 --seed 16 --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every 200 --log-every 10 --short-blocks 0.5 --threads 2 --repeat $REPEAT
    cp -r $R/dflash/drafter $B.tmp && mv $B.tmp $B
fi
$TF train average ${SHIPPED}-dflash $B --weights 1,2 --out $R/w12/drafter

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $R/w12/drafter"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage 16's backbone done: python scripts/ship_if_better.py --domains $R dflash@16,ddtree@16,dflash@4,ddtree@4"

bash scripts/stage_adapters.sh $R/w12/drafter $R $REPEAT 17 20 400 160
echo "stage 16 done: python scripts/ship_if_better.py --domains $R METHODS"
