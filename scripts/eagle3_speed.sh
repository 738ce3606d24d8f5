#!/usr/bin/env bash
# Issue 34's speed column: each drafter with `--budget auto` against `ar` in its own bench run (one run per drafter
# folder: `bench --drafter` takes one), on the command line's defaults (the Q4_1 GGUF on the int4 kernel, compiled),
# 10 prompts, 128 new tokens, T = 0 and 1, per domain. Timings: nothing else may run (pause training with SIGSTOP).
#
#   bash scripts/eagle3_speed.sh [OUT_DIR] [EQUAL_DRAFTER]   # docs/results/eagle3/speed runs/eq34/dflash/drafter
#   python scripts/eagle3_table.py docs/results/eagle3/eval runs/eq34/eval OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/eagle3/speed}
equal=${2:-runs/eq34/dflash/drafter}
speed() {  # speed NAME METHODS [DRAFTER]: one bench run per dataset and temperature, skipped where it exists
    local name=$1 methods=$2 extra=${3:+--drafter $3} t d
    for t in 0 1; do
        for d in gsm8k humaneval mbpp chat-dev; do
            [ -f "$out/$name/bench-$d-T$t.json" ] || METHODS=$methods EXTRA="--budget auto $extra" \
                bash scripts/bench_cpu_int4.sh "$out/$name" "$d" "$t"
        done
    done
}
speed shipped ar,dflash,ddtree,treeflash,tfm
speed eagle3 ar,eagle3 data/stages/smollm2-135m-instruct-eagle3
[ -d "$equal" ] && speed equal ar,dflash,ddtree "$equal"
