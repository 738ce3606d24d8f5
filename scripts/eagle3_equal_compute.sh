#!/usr/bin/env bash
# Issue 34's equal-compute arm: a DFlash drafter trained from scratch for the CPU seconds the EAGLE-3 drafter of
# data/stages had (1,200 steps, `docs/results/eagle3/train_args.json`), on the same answers, learning rate (6e-4),
# seed and schedule shape, then tau beside it with `paired` like scripts/eagle3_table.sh.
#
# Seconds are this machine's: both kinds first train K steps alone on the same batches (same seed, two threads), three
# times in turn (a VM's speed drifts: one pair timed at stop 58 gave 0.45 s of EAGLE-3 per DFlash second, another an
# hour later 0.76), and the DFlash run gets round(1200 x the median ratio) steps. The timings go into
# RUN_DIR/timing.json. Nothing else may run meanwhile (they decide the step count). A rerun skips what exists.
#
#   bash scripts/eagle3_equal_compute.sh [RUN_DIR] [K]         # defaults: runs/eq34 20
#   python scripts/eagle3_table.py docs/results/eagle3/eval RUN_DIR/eval
set -euo pipefail
cd "$(dirname "$0")/.."

TF=.venv/bin/treeflash
run=${1:-runs/eq34}
k=${2:-20}
common=(--batch-size 4 --max-len 512 --lr 6e-4 --seed 0 --threads 2)
mkdir -p "$run/eval"
bash ../shared/tools/machine-facts.sh > "$run/machine.txt" 2>/dev/null || true

for i in 1 2 3; do  # K steps of each, alone, on the same batches, in turn
    for kind in eagle3 dflash; do
        [ -f "$run/time$i-$kind/log.jsonl" ] || $TF train $kind --out "$run/time$i-$kind" --steps "$k" \
            --save-every 100000 --log-every 5 --no-resume "${common[@]}" > "$run/time$i-$kind.log" 2>&1
    done
done
steps=$(python - "$run" <<'EOF'
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
def per_step(folder):  # seconds a step after the first log line (start-up and the first steps excluded)
    rows = [json.loads(line) for line in (run / folder / "log.jsonl").open()]
    return (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]) / (rows[-1]["step"] - rows[0]["step"])
pairs = [{"eagle3_s_per_step": per_step(f"time{i}-eagle3"), "dflash_s_per_step": per_step(f"time{i}-dflash")}
         for i in (1, 2, 3)]
ratio = statistics.median(p["eagle3_s_per_step"] / p["dflash_s_per_step"] for p in pairs)
steps = round(1200 * ratio)
(run / "timing.json").write_text(json.dumps({"pairs": pairs, "median_ratio": ratio, "eagle3_steps": 1200,
                                             "dflash_steps": steps}, indent=2) + "\n")
print(steps)
EOF
)
echo "== DFlash from scratch: $steps steps ($run/timing.json)"
[ -f "$run/dflash/done" ] || {
    $TF train dflash --out "$run/dflash" --steps "$steps" --save-every 25 --log-every 10 "${common[@]}" \
        >> "$run/dflash.log" 2>&1 && touch "$run/dflash/done"; }

echo "== tau per domain and temperature, two at a time, each method on its own rounds"
for t in 0 1; do
    for dataset in chat-dev gsm8k humaneval mbpp; do
        for method in dflash ddtree; do
            echo "$run/eval/equal-$method-$dataset-T$t.json --dataset $dataset --temperature $t --methods $method \
                --drafter $run/dflash/drafter"
        done
    done
done | bash scripts/paired_jobs.sh 2 16,64

# The adapters on that backbone, from scratch, side by side (one thread each), for stated seconds on top of EAGLE-3's
# (their logs' elapsed_s): an AR layer as the shipped one (SwiGLU, width 768) and a Weaver, lr 1e-3 as their first runs.
echo "== TreeFlash AR layer and Weaver on it"
adapter=(--batch-size 4 --max-len 512 --lr 1e-3 --seed 0 --num-anchors 64 --save-every 25 --log-every 10 --threads 1)
[ -f "$run/treeflash/done" ] || { $TF train treeflash --backbone "$run/dflash/drafter" --freeze-backbone \
    --ar-intermediate-size 768 --out "$run/treeflash" --steps 300 "${adapter[@]}" >> "$run/treeflash.log" 2>&1 \
    && touch "$run/treeflash/done"; } &
[ -f "$run/weaver/done" ] || { $TF train weaver --backbone "$run/dflash/drafter" --out "$run/weaver" --steps 200 \
    "${adapter[@]}" >> "$run/weaver.log" 2>&1 && touch "$run/weaver/done"; } &
wait
[ -f "$run/treeflash/done" ] && [ -f "$run/weaver/done" ] || { echo "adapter training failed: $run/*.log"; exit 1; }
for t in 0 1; do
    for dataset in chat-dev gsm8k humaneval mbpp; do
        echo "$run/eval/equal-treeflash-$dataset-T$t.json --dataset $dataset --temperature $t --methods treeflash \
            --drafter $run/treeflash/drafter"
        echo "$run/eval/equal-tfm-$dataset-T$t.json --dataset $dataset --temperature $t --methods tfm \
            --drafter $run/dflash/drafter --weaver $run/weaver/weaver"
    done
done | bash scripts/paired_jobs.sh 2 16,64
echo "== done: $run/eval"
