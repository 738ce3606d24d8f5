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

drafter=${1:-data/stages/smollm2-135m-instruct-eagle3}
out=${2:-docs/results/eagle3/eval}
jobs=${3:-1}
mkdir -p "$out"
bash ../shared/tools/machine-facts.sh > "$out/machine.txt" 2>/dev/null || true

for t in 0 1; do
    for dataset in chat-dev gsm8k humaneval mbpp; do
        echo "$out/eagle3-$dataset-T$t.json --dataset $dataset --temperature $t --methods eagle3 --drafter $drafter"
        for method in dflash ddtree treeflash tfm; do  # each on its own driver: paired's first method drives
            echo "$out/shipped-$method-$dataset-T$t.json --dataset $dataset --temperature $t --methods $method"
        done
    done
done | bash scripts/paired_jobs.sh "$jobs" 16,64
echo "== done: $out"
