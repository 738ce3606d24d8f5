#!/usr/bin/env bash
# Stage 17 of issue #30: the shipped backbone trained 500 more steps on the answer store with the target's own chat
# requests added (source magpie: 5,313 greedy answers to requests it wrote, shards 41-53 of data/answers, once an
# epoch) beside stage 15's mix; stage 16 (`../stage16/`) showed that more steps on the old mix no longer move the
# drafter. Then the mean weighted 2:1 towards it against the shipped one, and the adapters on it from the shipped
# ones (the same mix). The verdict's shipped side is stage 15's own verdict reports, valid while stage 15's drafters
# ship. Then, with METHODS dflash@16,ddtree@16,dflash@4,ddtree@4,treeflash@16,treeflash@4,tfm@16,tfm@4:
# python scripts/ship_if_better.py --domains runs/s17 METHODS
#
#   nohup bash docs/results/training/stage17/stage17.sh > runs/s17/stage17.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
exec bash scripts/stage.sh 17 500 sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2 \
    docs/results/training/stage15/cmp/eval 18 21 400 160
