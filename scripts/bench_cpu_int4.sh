#!/usr/bin/env bash
# The issue-29 tables: every engine in one run per dataset and temperature, on the default target as shipped (its
# Q4_1 GGUF on the int4 kernel, bf16 activations: the command line's defaults), llama.cpp in its own process.
# Usage: bash scripts/bench_cpu_int4.sh [OUT_DIR] [DATASETS] [TEMPERATURES]   (METHODS=... to choose the engines,
# EXTRA="--drafter FOLDER ..." for more bench options)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/cpu-int4}
datasets=${2:-"gsm8k humaneval mbpp chat-dev"}
temperatures=${3:-"0 1"}
methods=${METHODS:-ar,pld,dflash,ddtree,treeflash,tfm,hf,llamacpp,llamacpp-pld}
mkdir -p "$out"
bash ../shared/tools/machine-facts.sh > "$out/machine.txt" 2>/dev/null || true
for t in $temperatures; do
  for d in $datasets; do
    .venv/bin/treeflash bench --dataset "$d" --limit 10 --max-new-tokens 128 --temperature "$t" \
      --methods "$methods" --no-progress ${EXTRA:-} \
      --out "$out/bench-$d-T$t.json" > "$out/bench-$d-T$t.txt" 2>&1 || echo "bench $d T = $t failed: see $out/bench-$d-T$t.txt"
  done
done
