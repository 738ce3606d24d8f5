#!/usr/bin/env bash
# The shipped drafters' pipeline, from data to checkpoints, resumable: run it again after an interruption and each
# step picks up where it stopped (`data regen` skips the answers already written, `train` resumes from its
# checkpoint.pt, a finished step returns at once). Every number that shapes the result is set here.
#
#   bash scripts/train_all.sh            # DATA_DIR, RUNS and the *_STEPS below can be overridden from the environment
#
# 1. the target's answers: greedy for every training prompt, T = 1 samples for a third of each source (the chat
#    dev set is never regenerated nor trained on); docs/data/regen-manifest.json records what the folders hold;
# 2. the DFlash drafter, in the published format (a real mask token), and its FR-Spec token ranking;
# 3. the TreeFlash AR layer and the Weaver on the frozen DFlash drafter, side by side, one thread each, twice (the
#    second run goes on from the first's end);
# 4. tau per domain (chat-dev, GSM8K, HumanEval, MBPP) of the new drafters and of the shipped ones, with `paired`,
#    into $RUNS/eval, and the learning curve: tau on chat-dev and GSM8K of the DFlash snapshots.
# Shipping is a decision, not a step: copy the new folders into src/treeflash/checkpoints only if they beat the
# shipped ones on every domain, and write the model cards from $RUNS/eval.
set -euo pipefail
cd "$(dirname "$0")/.."

TF=.venv/bin/treeflash
DATA_DIR=${DATA_DIR:-../treeflash-data}  # outside the repository: docs/data/README.md
RUNS=${RUNS:-runs/all}
DFLASH_STEPS=${DFLASH_STEPS:-2000}       # 4 sequences a step: about half a pass over greedy + sampled answers
TREEFLASH_STEPS=${TREEFLASH_STEPS:-400}
WEAVER_STEPS=${WEAVER_STEPS:-600}
TREEFLASH_MORE_STEPS=${TREEFLASH_MORE_STEPS:-700}  # the adapters again, from their ends (they were still learning)
WEAVER_MORE_STEPS=${WEAVER_MORE_STEPS:-600}
REGEN=(--batch-size 48 --max-new-tokens 256 --dtype bfloat16)
TRAIN=(--batch-size 4 --num-anchors 32 --max-len 512 --save-every 50 --keep-every 500 --log-every 10)

echo "== 1. data into $DATA_DIR"
$TF data regen --out "$DATA_DIR/regen" "${REGEN[@]}"
third=$(.venv/bin/python -c "from treeflash.eval.datasets import default_data_dir as d
from treeflash.train.data import SOURCES, training_prompts as t; print(len(t(d(), list(SOURCES))) // 3)")
# --limit over several sources takes prompts evenly across them: a third of each
$TF data regen --out "$DATA_DIR/regen-t1" --temperature 1 --limit "$third" --seed 1 "${REGEN[@]}"
DATA="$DATA_DIR/regen,$DATA_DIR/regen-t1"
mkdir -p docs/data
$TF data manifest "$DATA" --out docs/data/regen-manifest.json > /dev/null

echo "== 2. DFlash"
$TF train dflash --data "$DATA" --out "$RUNS/dflash" --steps "$DFLASH_STEPS" "${TRAIN[@]}"
$TF data rank --data "$DATA" --drafter "$RUNS/dflash/drafter" --size 4096

echo "== 3. TreeFlash AR layer and Weaver on the frozen DFlash drafter"
# the AR layer at half the MLP's width: the published TreeFlash layout (the full width) would take the three shipped
# drafters past their 40 MB budget (8.9 MB instead of 4.4); it saves in treeflash's own layout
OMP_NUM_THREADS=1 $TF train treeflash --backbone "$RUNS/dflash/drafter" --freeze-backbone --ar-intermediate-size 768 \
    --data "$DATA" --out "$RUNS/treeflash" --steps "$TREEFLASH_STEPS" --lr 1e-3 "${TRAIN[@]}" &
OMP_NUM_THREADS=1 $TF train weaver --backbone "$RUNS/dflash/drafter" --data "$DATA" \
    --out "$RUNS/weaver" --steps "$WEAVER_STEPS" --lr 1e-3 "${TRAIN[@]}" &
wait -n && wait -n  # both must succeed
# then both again from where they ended, on another data order (--seed 1), with a second cosine from half the
# learning rate: their losses were still falling. These are what ship
OMP_NUM_THREADS=1 $TF train treeflash --backbone "$RUNS/dflash/drafter" --freeze-backbone --init "$RUNS/treeflash/drafter" \
    --data "$DATA" --out "$RUNS/treeflash-more" --steps "$TREEFLASH_MORE_STEPS" --lr 5e-4 --seed 1 "${TRAIN[@]}" &
OMP_NUM_THREADS=1 $TF train weaver --backbone "$RUNS/dflash/drafter" --init "$RUNS/weaver/weaver" \
    --data "$DATA" --out "$RUNS/weaver-more" --steps "$WEAVER_MORE_STEPS" --lr 5e-4 --seed 1 "${TRAIN[@]}" &
wait -n && wait -n

echo "== 4. tau per domain, new and shipped drafters, and the DFlash learning curve"
mkdir -p "$RUNS/eval"
paired() {  # paired OUT ARGS...: skipped when OUT exists, so that a rerun picks up where it stopped
    local out=$1; shift
    [ -f "$out" ] || $TF paired --limit 10 --max-new-tokens 128 --budget 16 --no-progress "$@" --out "$out.tmp"
    [ -f "$out" ] || mv "$out.tmp" "$out"
}
for dataset in chat-dev gsm8k humaneval mbpp; do
    paired "$RUNS/eval/paired-$dataset.json" --dataset "$dataset" --methods dflash,ddtree,treeflash,tfm \
        --drafter "$RUNS/treeflash-more/drafter" --weaver "$RUNS/weaver-more/weaver"
    # the same for the drafters shipped now (the defaults): at T = 0 both follow the target's greedy continuation
    paired "$RUNS/eval/shipped-$dataset.json" --dataset "$dataset" --methods dflash,ddtree,treeflash,tfm
done
# learning curves: ddtree on the DFlash snapshots (the last one is the drafter above); the adapters, trained for
# 600 steps, are measured at their end only (their loss curves are in their log.jsonl)
for dataset in chat-dev gsm8k; do
    for snap in "$RUNS"/dflash/drafter-step*; do
        [ "${snap##*-}" = "$(printf step%06d "$DFLASH_STEPS")" ] && continue
        paired "$RUNS/eval/curve-dflash-${snap##*-}-$dataset.json" --dataset "$dataset" --methods ddtree --drafter "$snap"
    done
done
echo "done: compare $RUNS/eval with the shipped drafters' figures before shipping"
