#!/usr/bin/env bash
# The shipped drafters' pipeline, from answers to checkpoints, in resumable stages that survive a change of machine.
# Run it again after an interruption and each step picks up where it stopped: `data regen` resumes from the answer
# store in data/answers (committed), `train` from its run folder's checkpoint.pt, a finished step returns at once,
# an evaluation that exists is not run again. Every number that shapes the result is set here.
#
#   bash scripts/train_all.sh            # RUNS, STAGE_STEPS, ... below can be overridden from the environment
#
# 1. answers (data/answers): greedy for every training prompt, T = 1 samples for a third of each source; the chat
#    dev set is never answered nor trained on. Commit data/answers as it grows: it is what costs the CPU hours.
# 2. DFlash, stage by stage: stage 1 goes on from the shipped drafter (bf16 weights, a fresh AdamW, 4 % warm-up
#    then cosine to 0 over the stage, peak --lr $LR) when $RUNS has no stage yet; stage k from stage k-1's end.
#    A stage is $STAGE_STEPS steps of 4 sequences, 512 anchors each (about 11,000 drafted positions and 9 s a
#    step on 2 cores, AVX512-BF16: 1,500 steps are 16 M positions in about 3.7 hours).
# 3. tau per domain (chat-dev, GSM8K, HumanEval, MBPP) of the stage's drafter and of the shipped one, with `paired`,
#    each method on its own rounds, at B = 16 and 4 (scripts/ship_if_better.py prints the table for the model card);
# 4. where the stage's drafter beats the shipped one on every domain (scripts/ship_if_better.py --domains: each
#    domain's cells' geometric mean ratio above 1, no cell significantly worse over the prompts): the TreeFlash AR
#    layer and the Weaver on it (frozen backbone, from the shipped ones, one thread each, side by side); if the
#    stage's three drafters beat the shipped ones on every domain by the same rule, over all eight cells, they replace
#    the shipped drafters (SHIP=1), together: the adapters are tied to their backbone.
# Commit after each stage: the store, the shipped folders and $RUNS/*/eval/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."

TF=.venv/bin/treeflash
PY=.venv/bin/python
RUNS=${RUNS:-runs/all}
STAGES=${STAGES:-1}               # stages to reach in this call (a rerun goes on where the last one stopped)
STAGE_STEPS=${STAGE_STEPS:-1500}  # 4 sequences a step, about 2,500 drafted positions a sequence: 15 M a stage
LR=${LR:-3e-4}                    # the shipped drafter is trained already: half the fresh peak
ADAPTER_STEPS=${ADAPTER_STEPS:-600}
SHIP=${SHIP:-0}
BUDGETS=${BUDGETS:-16,4}          # the tree sizes a stage must win at: 16, and 4 near what --budget auto picks on a CPU
ANSWERS=${ANSWERS:-1}             # 0: train on data/answers as it stands (skip step 1's regen)
SHIPPED=src/treeflash/checkpoints
REGEN=(--batch-size 48 --max-new-tokens 256 --dtype bfloat16)
TRAIN=(--batch-size 4 --max-len 512 --save-every 50 --keep-every 500 --log-every 10)

if [ "$ANSWERS" = 1 ]; then
    echo "== 1. answers into data/answers"
    $TF data regen "${REGEN[@]}"
    third=$($PY -c "from treeflash.eval.datasets import default_data_dir as d
from treeflash.train.data import SOURCES, training_prompts as t; print(len(t(d(), list(SOURCES))) // 3)")
    # --limit over several sources takes prompts evenly across them: a third of each
    $TF data regen --temperature 1 --limit "$third" --seed 1 "${REGEN[@]}"
fi
$TF data check

evaluate() {  # evaluate RUN METHODS ARGS...: tau per domain of RUN's drafters and of the shipped ones, two jobs at a
    # time (scripts/paired_jobs.sh: a rerun skips finished reports); one run per method, as paired scores a run's
    # methods on its first one's rounds
    local run=$1 methods=$2 dataset method; shift 2
    mkdir -p "$run/eval"
    for dataset in chat-dev gsm8k humaneval mbpp; do
        for method in ${methods//,/ }; do
            echo "$run/eval/new-$dataset-$method.json --dataset $dataset --methods $method $*"
            echo "$run/eval/shipped-$dataset-$method.json --dataset $dataset --methods $method"
        done
    done | bash scripts/paired_jobs.sh 2 "$BUDGETS"
}
at_budgets() {  # at_budgets a,b -> a@16,a@4,b@16,b@4: the columns ship_if_better compares (paired's names)
    [[ $BUDGETS == *,* ]] || { echo "$1"; return; }  # one budget: no @ in the names
    local m b out=()
    for m in ${1//,/ }; do for b in ${BUDGETS//,/ }; do out+=("$m@$b"); done; done
    local IFS=,; echo "${out[*]}"
}

previous="$SHIPPED/smollm2-135m-instruct-dflash"
for stage in $(seq 1 "$STAGES"); do
    run="$RUNS/dflash-stage$stage"
    echo "== 2. DFlash stage $stage from $previous"
    $TF train dflash --init "$previous" --out "$run" --steps "$STAGE_STEPS" --lr "$LR" --seed "$stage" "${TRAIN[@]}"
    echo "== 3. tau of stage $stage"
    evaluate "$run" dflash,ddtree --drafter "$run/drafter"
    # the adapters are tied to their backbone (its sha256): a backbone ships with adapters trained on it, or not at all
    if $PY scripts/ship_if_better.py --domains "$run" "$(at_budgets dflash,ddtree)"; then
        echo "== 4. adapters on the stage-$stage backbone"
        OMP_NUM_THREADS=1 $TF train treeflash --backbone "$run/drafter" --freeze-backbone \
            --init "$SHIPPED/smollm2-135m-instruct-treeflash" --out "$run/treeflash" \
            --steps "$ADAPTER_STEPS" --lr 5e-4 "${TRAIN[@]}" &
        OMP_NUM_THREADS=1 $TF train weaver --backbone "$run/drafter" --init "$SHIPPED/smollm2-135m-instruct-weaver" \
            --out "$run/weaver" --steps "$ADAPTER_STEPS" --lr 5e-4 "${TRAIN[@]}" &
        wait -n && wait -n  # both must succeed
        evaluate "$run" treeflash --drafter "$run/treeflash/drafter"
        evaluate "$run" tfm --drafter "$run/drafter" --weaver "$run/weaver/weaver"
        $PY scripts/ship_if_better.py --domains "$run" "$(at_budgets dflash,ddtree,treeflash,tfm)" "$SHIP" \
            "$run/drafter" "$SHIPPED/smollm2-135m-instruct-dflash" \
            "$run/treeflash/drafter" "$SHIPPED/smollm2-135m-instruct-treeflash" \
            "$run/weaver/weaver" "$SHIPPED/smollm2-135m-instruct-weaver" || true
    fi
    previous="$run/drafter"
done
echo "done: commit data/answers, $RUNS/*/eval and whatever shipped, with the model cards' tables"
