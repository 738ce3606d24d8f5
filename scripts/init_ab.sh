#!/usr/bin/env bash
# A/B of a fresh DFlash drafter's start: random layers against copies of the target's last layers (the deepest tap
# as context), at equal drafted positions (same data, seed, sequences and anchors), then ddtree tau on chat-dev and
# GSM8K with `paired`. Both arms read one snapshot of the answer store ($OUT/answers, copied at the first call), so
# a store that grows meanwhile (a regen beside it) changes neither arm's data. tau does not depend on the wall clock,
# so the arms may share the machine: PARALLEL=1 THREADS=1 runs both at once, one core each. Writes $OUT/{random,target}/, ab.json.
#
#   bash scripts/init_ab.sh [STEPS]        # STEPS of 4 sequences per arm (160); OUT=runs/init-ab, THREADS
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-160}
OUT=${OUT:-runs/init-ab}
TF=.venv/bin/treeflash
THREADS=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$THREADS  # paired too
if [ ! -d "$OUT/answers" ]; then  # one command a line: set -e does not stop at a failure left of && or ||
    mkdir -p "$OUT"
    cp -r data/answers "$OUT/answers.tmp"
    mv "$OUT/answers.tmp" "$OUT/answers"
fi
arm() {
    $TF train dflash --init-layers "$1" --out "$OUT/$1" --steps "$STEPS" --batch-size 4 --max-len 512 \
        --save-every 50 --log-every 10 --seed 0 --data "$OUT/answers" --threads "$THREADS"
    for dataset in chat-dev gsm8k; do
        f="$OUT/$1/paired-$dataset.json"
        [ -f "$f" ] || $TF paired --dataset "$dataset" --limit 10 --max-new-tokens 128 --budget 16 --methods ddtree \
            --drafter "$OUT/$1/drafter" --no-progress --out "$f"
    done
}
if [ "${PARALLEL:-0}" = 1 ]; then  # both arms at once (THREADS=1 each on a 2-core machine)
    arm random & arm target & wait -n && wait -n
else
    arm random && arm target
fi
.venv/bin/python - "$OUT" "$(../shared/tools/machine-facts.sh 2>/dev/null || true)" <<'PY'
import json, sys
from pathlib import Path
out, facts = Path(sys.argv[1]), sys.argv[2]
rows = {}
for arm in ("random", "target"):
    log = [json.loads(line) for line in open(out / arm / "log.jsonl")]
    tail = log[-5:]
    rows[arm] = {"positions": log[-1]["positions"], "steps": log[-1]["step"],
                 "loss": sum(r["loss"] for r in tail) / len(tail), "acc_k1": sum(r["acc_k1"] for r in tail) / len(tail),
                 **{f"ddtree_tau_{d}": json.loads((out / arm / f"paired-{d}.json").read_text())["methods"]["ddtree"]["expected_tau"]
                    for d in ("chat-dev", "gsm8k")}}
print(f"{'start':8} {'positions':>10} {'loss':>7} {'acc@1':>6} {'tau chat-dev':>12} {'tau gsm8k':>10}")
for arm, r in rows.items():
    print(f"{arm:8} {r['positions']:10d} {r['loss']:7.3f} {r['acc_k1']:6.3f} {r['ddtree_tau_chat-dev']:12.3f} {r['ddtree_tau_gsm8k']:10.3f}")
print("loss and acc@1: mean of the last 5 log lines; machine:", facts)
(out / "ab.json").write_text(json.dumps({"machine": facts, "arms": rows}, indent=2) + "\n")
PY
