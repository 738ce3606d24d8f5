#!/usr/bin/env bash
# Drafted positions per second of `treeflash train dflash`: the recipe before issue #30 (commit $OLD, run from a
# git worktree of it) and the levers after it, one at a time, on the same answers and sequences, one run after
# another (nothing else may run: pause long jobs with kill -STOP first). Prints a table, writes $OUT/throughput.json.
#
#   bash scripts/train_throughput.sh [STEPS]        # STEPS per run (12); OUT=runs/throughput
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-12}
OUT=${OUT:-runs/throughput}
OLD=${OLD:-46c2f61}
PY=.venv/bin/python
mkdir -p "$OUT"
COMMON=(--steps "$STEPS" --batch-size 4 --max-len 512 --log-every 2 --save-every 100000 --no-resume)

# the old commit reads JSONL folders of rows with prompt ids: the same answers, exported from the store
if [ ! -d "$OUT/old-src" ]; then git worktree add --detach "$OUT/old-src" "$OLD" >/dev/null; fi
if [ ! -f "$OUT/jsonl/shard-00000.jsonl" ]; then
    mkdir -p "$OUT/jsonl"
    $PY - "$OUT/jsonl" <<'PY'
import json, sys
from pathlib import Path
from treeflash.eval.datasets import default_data_dir
from treeflash.runtime import Target
from treeflash.train.store import load_answers
rows = load_answers("data/answers", Target.load("smollm2-135m-instruct", dtype="bfloat16").encode_prompt,
                    default_data_dir())
with open(Path(sys.argv[1]) / "shard-00000.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
PY
fi

run() {  # run NAME ARGS...: one training run, its log in $OUT/NAME
    local name=$1; shift
    echo "== $name: $*"
    "$@" "${COMMON[@]}" --out "$OUT/$name" > "$OUT/$name.out" 2> "$OUT/$name.err"
}
run old env PYTHONPATH="$OUT/old-src/src" $PY -m treeflash.cli train dflash --data "$OUT/jsonl" --num-anchors 32
run new-32-all $PY -m treeflash.cli train dflash --num-anchors 32 --draft-vocab 0
run new-32-fr $PY -m treeflash.cli train dflash --num-anchors 32
run new-512-all $PY -m treeflash.cli train dflash --num-anchors 512 --draft-vocab 0
run new $PY -m treeflash.cli train dflash

$PY - "$OUT" "$(../shared/tools/machine-facts.sh 2>/dev/null || true)" <<'PY'
import json, sys
from pathlib import Path
out, facts = Path(sys.argv[1]), sys.argv[2]
names = {"old": "before #30: 32 anchors, the whole vocabulary, one SDPA over the flattened blocks",
         "new-32-all": "32 anchors, the whole vocabulary (new attention, target view)",
         "new-32-fr": "32 anchors, FR-Spec loss over 4,096 rows",
         "new-512-all": "512 anchors (every answer position), the whole vocabulary",
         "new": "512 anchors, FR-Spec loss over 4,096 rows (the default now)"}
phases = ["s_target", "s_drafter_forward", "s_backward", "s_optimizer"]
rows = []
for name, what in names.items():
    log = [json.loads(line) for line in open(out / name / "log.jsonl")]
    first, last = log[0], log[-1]  # the first window (warm-up) is left out
    positions = sum(r["tokens"] * 2 * 4 for r in log[1:])  # per-sequence mean x log_every x batch size
    rate = positions / (last["elapsed_s"] - first["elapsed_s"])
    row = {"run": name, "recipe": what, "positions_per_s": rate, "positions_per_sequence": last["tokens"],
           **{p: sum(r[p] for r in log[1:]) / len(log[1:]) for p in phases if p in last}}
    rows.append(row)
base = rows[0]["positions_per_s"]
print(f"{'run':12} {'positions/s':>11} {'x old':>6} {'pos/seq':>7} " + " ".join(f"{p[2:]:>15}" for p in phases))
for r in rows:
    print(f"{r['run']:12} {r['positions_per_s']:11.0f} {r['positions_per_s'] / base:6.2f} "
          f"{r['positions_per_sequence']:7.0f} " + " ".join(f"{r[p]:15.3f}" if p in r else f"{'-':>15}" for p in phases))
print("seconds per sequence by phase; machine:", facts)
(out / "throughput.json").write_text(json.dumps({"machine": facts, "runs": rows}, indent=2) + "\n")
PY
