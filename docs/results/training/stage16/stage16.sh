#!/usr/bin/env bash
# Stage 16 of issue #30: the shipped stage-15 backbone trained 400 more steps on stage 15's mix, then weighted 2:1
# towards it against the shipped one (stage 15's best candidate was that mean); the adapters on it from the shipped
# ones, 400 and 160 steps. Shorter than stage 15 so that one session holds the whole stage. The verdict's shipped
# side is stage 15's own verdict reports of the same (then shipped) drafters (scripts/stage.sh says why that holds).
# It ran as one script of these steps at commit 6a2c739, scripts/stage.sh's body with these numbers.
#
#   nohup bash docs/results/training/stage16/stage16.sh > runs/s16/stage16.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
exec bash scripts/stage.sh 16 400 sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2 \
    docs/results/training/stage15/cmp/eval 17 20 400 160
