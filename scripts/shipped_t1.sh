#!/usr/bin/env bash
# The shipped drafters' E[tau] at T = 1 (issue #30: "a table, no target"): `treeflash paired` on 10 prompts of each
# domain, 128 new tokens, B = 16, one method a run so that each is scored on its own sampled rounds, into
# OUT/M-D-T1.json (2 jobs at a time, one thread each; a report that exists is skipped). Then
# `python scripts/t1_table.py OLD_OUT OUT` prints the table against an earlier run.
#
#   bash scripts/shipped_t1.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?output folder}
mkdir -p "$OUT"
for d in chat-dev gsm8k humaneval mbpp; do
    for m in dflash ddtree treeflash tfm; do
        echo "$OUT/$m-$d-T1.json --dataset $d --temperature 1 --methods $m"
    done
done | bash scripts/paired_jobs.sh 2 16
