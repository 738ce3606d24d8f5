#!/usr/bin/env bash
# Stage 18 of issue #30, the learning-rate A/B: stage 17 again (`../stage17/`: the same 500 steps from the shipped
# backbone, the same store, mix and seed 17, so the same answers in the same order) at twice the peak learning rate,
# 3e-4 against 1.5e-4 (cosine, 4 % warm-up, as every stage since 10). Stage 17 is the A arm. Then its 2:1 mean with
# the shipped backbone and the adapters on it, as in every stage; the verdict against the shipped drafters:
# python scripts/ship_if_better.py --domains runs/s18 METHODS
#
#   nohup bash docs/results/training/stage18/stage18.sh > runs/s18/stage18.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../../.."
LR=3e-4 SEED=17 exec bash scripts/stage.sh 18 500 sharegpt@0=4,gsm8k@0=2,code_alpaca@0=3,mbpp@0=2 \
    docs/results/training/stage15/cmp/eval 18 21 400 160
