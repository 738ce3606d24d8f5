#!/usr/bin/env bash
# One training stage of issue #30 from the shipped drafters: the shipped DFlash backbone trained STEPS more steps on
# data/answers as it stands (seed $SEED, default STAGE; the --repeat mix REPEAT; peak lr $LR, default 1.5e-4, cosine;
# short blocks), kept in data/stages; the mean weighted 2:1 towards it against the shipped one (`train average
# --weights 1,2`), its `paired` reports per domain; then the adapters on it from the shipped ones
# (scripts/stage_adapters.sh). The verdict's shipped side is copied from SHIPPED_REPORTS (new-*.json of the verdict
# that shipped the drafters shipped now: the same weights bit for bit, and paired is deterministic at T = 0). Rerun to
# resume: training resumes from its last save, or is skipped once its backbone is kept in data/stages; an evaluation
# whose report exists is skipped. Then: python scripts/ship_if_better.py --domains runs/sSTAGE METHODS.
#
#   [LR=...] [SEED=...] bash scripts/stage.sh STAGE STEPS REPEAT SHIPPED_REPORTS TREEFLASH_SEED WEAVER_SEED \
#       TREEFLASH_STEPS WEAVER_STEPS
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?stage} STEPS=${2:?steps} REPEAT=${3:?--repeat mix} REPORTS=${4:?the shipped drafters verdict reports}
R=runs/s$STAGE TF=${TF:-.venv/bin/treeflash} S=data/stages/smollm2-135m-instruct LR=${LR:-1.5e-4} SEED=${SEED:-$STAGE}
SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct
mkdir -p $R/eval
../shared/tools/machine-facts.sh > $R/machine.txt
for f in "$REPORTS"/new-*.json; do
    cp -n "$f" "$R/eval/shipped-${f##*/new-}"
done

B=${S}-dflash-stage$STAGE
if [ ! -d $B ]; then
    $TF train dflash --init ${SHIPPED}-dflash --out $R/dflash --steps $STEPS --lr $LR --seed $SEED --batch-size 4 \
        --max-len 512 --save-every 25 --keep-every $((STEPS / 2)) --log-every 10 --short-blocks 0.5 --threads 2 \
        --repeat $REPEAT
    cp -r $R/dflash/drafter $B.tmp  # two commands: set -e does not stop at a failed `cp` left of &&
    mv $B.tmp $B
fi
$TF train average ${SHIPPED}-dflash $B --weights 1,2 --out $R/w12/drafter

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d.json --dataset $d --methods dflash,ddtree --drafter $R/w12/drafter"
done | bash scripts/paired_jobs.sh 2 16,4
echo "stage $STAGE's backbone done: python scripts/ship_if_better.py --domains $R dflash@16,ddtree@16,dflash@4,ddtree@4"

bash scripts/stage_adapters.sh $R/w12/drafter $R $REPEAT "${5:?treeflash seed}" "${6:?weaver seed}" \
    "${7:?treeflash steps}" "${8:?weaver steps}"
echo "stage $STAGE done: python scripts/ship_if_better.py --domains $R METHODS"
