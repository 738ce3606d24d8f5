#!/usr/bin/env bash
# Run `treeflash paired` jobs read from stdin, one a line: OUT ARGS... (10 prompts, 128 new tokens, the budgets
# given, one thread each, JOBS at a time: tau does not depend on the clock). A job whose OUT exists is skipped; a
# job writes OUT.log, and OUT.tmp renamed to OUT once it has finished, so that a rerun goes on where one stopped.
#
#   ... | bash scripts/paired_jobs.sh JOBS BUDGETS      # e.g. 2 16,64
set -euo pipefail
cd "$(dirname "$0")/.."

export TF=${TF:-.venv/bin/treeflash} BUDGETS=${2:?budgets, e.g. 16,64}
paired() {  # paired OUT ARGS...
    local file=$1; shift
    [ -f "$file" ] || OMP_NUM_THREADS=1 $TF paired --limit 10 --max-new-tokens 128 --budget "$BUDGETS" --no-progress \
        "$@" --out "$file.tmp" > "$file.log" 2>&1
    [ -f "$file" ] || mv "$file.tmp" "$file"
}
export -f paired
xargs -P "${1:?jobs}" -L 1 bash -c 'paired "$@"' _
