#!/usr/bin/env bash
# The GPU check: about 6 minutes on one H200, under 10. It needs the repository and PyPI packages only (CUDA
# torch, triton, and treeflash's requirements: `pip install -e ".[test]"`): the target and the drafters are random
# models with real shapes (scripts/gpu_check.py says what each step runs). Run it from the repository root; each
# step has its own timeout and writes STEP.json into $OUT (default: ./gpu_check), and a failed step does not stop
# the next. The exit status says whether all of them passed. Named steps (`scripts/gpu_check.sh speed graphs`) run
# alone.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export TREEFLASH_COMMIT="${TREEFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
OUT="${OUT:-gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
failed=()
only=" $* "
step() {  # step SECONDS NAME COMMAND...
    local limit=$1 name=$2
    shift 2
    [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 0
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@"
    local rc=$?
    [ $rc -eq 124 ] && echo "!! $name timed out"
    [ $rc -eq 0 ] || { echo "!! $name failed (exit $rc)"; failed+=("$name"); }
}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
step 20 versions "$PY" scripts/gpu_check.py versions --out "$OUT"
step 50 triton "$PY" scripts/gpu_check.py triton --out "$OUT"
step 50 gdn-bench sh -c "'$PY' -m treeflash.cli gdn-bench --device cuda --tree-size 16,32,64,128 --repeats 10 \
    --json > '$OUT/gdn_bench.json'"
step 170 correctness "$PY" scripts/gpu_check.py correctness --out "$OUT"
step 200 speed "$PY" scripts/gpu_check.py speed --out "$OUT"

step 60 train "$PY" scripts/gpu_check.py train --out "$OUT"
[ ${#failed[@]} -eq 0 ] && echo "all steps passed" || { echo "failed: ${failed[*]}"; exit 1; }
