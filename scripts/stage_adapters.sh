#!/usr/bin/env bash
# The adapters of one training stage (issue #30) on its new backbone: the TreeFlash AR layer (500 steps unless given,
# backbone frozen) and the Weaver (200 steps unless given), each from the shipped one, one thread each side by side;
# then their evaluations (`paired`, 10 prompts, budgets 16 and 4) as RUN/eval/new-D-treeflash.json and
# new-D-tfm.json, for scripts/ship_if_better.py against the shipped adapters' reports. Rerun to resume: an adapter's
# training resumes from its last save, an evaluation whose report exists is skipped.
#
#   bash scripts/stage_adapters.sh BACKBONE RUN REPEAT TREEFLASH_SEED WEAVER_SEED [TREEFLASH_STEPS WEAVER_STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:?backbone folder} R=${2:?run folder} REPEAT=${3:?--repeat mix}
TF=${TF:-.venv/bin/treeflash} SHIPPED=src/treeflash/checkpoints/smollm2-135m-instruct
mkdir -p "$R/eval"

adapter() {  # adapter KIND STEPS SEED [FLAG]
    OMP_NUM_THREADS=1 $TF train "$1" --backbone "$B" ${4:-} --init "$SHIPPED-$1" --out "$R/$1" --steps "$2" \
        --lr 3e-4 --seed "$3" --batch-size 4 --max-len 512 --num-anchors 64 --save-every 25 --log-every 10 \
        --threads 1 --repeat "$REPEAT" > "$R/$1.log" 2>&1
}
adapter treeflash "${6:-500}" "${4:?treeflash seed}" --freeze-backbone & treeflash=$!
adapter weaver "${7:-200}" "${5:?weaver seed}" & weaver=$!
wait $treeflash  # either failing stops the script (see RUN/KIND.log)
wait $weaver

for d in chat-dev gsm8k humaneval mbpp; do
    echo "$R/eval/new-$d-treeflash.json --dataset $d --methods treeflash --drafter $R/treeflash/drafter"
    echo "$R/eval/new-$d-tfm.json --dataset $d --methods tfm --drafter $B --weaver $R/weaver/weaver"
done | bash scripts/paired_jobs.sh 2 16,4
