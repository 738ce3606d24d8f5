#!/usr/bin/env bash
# Issue 34's table: tau of the EAGLE-3 drafter (method eagle3) beside the shipped drafters' dflash, ddtree, treeflash
# and tfm, per domain, at T = 0 (tau) and T = 1 (E[tau]), at B = 16 and 64; `paired` on the fp32 target, 10 prompts,
# 128 new tokens, one thread per run (tau does not depend on the clock), one method per run, so that each method's
# rounds are its own (`paired` scores a run's methods on the rounds its first method drives). A rerun skips what
# exists.
#
#   bash scripts/eagle3_table.sh [EAGLE3_DRAFTER] [OUT_DIR] [JOBS]
#   # defaults: data/stages/smollm2-135m-instruct-eagle3 docs/results/eagle3/eval 1
#   python scripts/eagle3_table.py [OUT_DIR]      # the markdown table
set -euo pipefail
cd "$(dirname "$0")/.."

export TF=.venv/bin/treeflash
drafter=${1:-data/stages/smollm2-135m-instruct-eagle3}
out=${2:-docs/results/eagle3/eval}
jobs=${3:-1}
mkdir -p "$out"
bash ../shared/tools/machine-facts.sh > "$out/machine.txt" 2>/dev/null || true

paired() {  # paired OUT ARGS...
    local file=$1; shift
    [ -f "$file" ] || OMP_NUM_THREADS=1 $TF paired --limit 10 --max-new-tokens 128 --budget 16,64 --no-progress "$@" \
        --out "$file.tmp" > "$file.log" 2>&1
    [ -f "$file" ] || mv "$file.tmp" "$file"
}
export -f paired
for t in 0 1; do
    for dataset in chat-dev gsm8k humaneval mbpp; do
        echo "$out/eagle3-$dataset-T$t.json --dataset $dataset --temperature $t --methods eagle3 --drafter $drafter"
        for method in dflash ddtree treeflash tfm; do  # each on its own driver: paired's first method drives
            echo "$out/shipped-$method-$dataset-T$t.json --dataset $dataset --temperature $t --methods $method"
        done
    done
done | xargs -P "$jobs" -L 1 bash -c 'paired "$@"' _
echo "== done: $out"
