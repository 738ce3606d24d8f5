#!/usr/bin/env bash
# GPU check for the GDN tree kernel (a few minutes on one GPU): the Triton kernel compiled for CUDA against the
# per-branch reference, then `treeflash gdn-bench` on CUDA (Triton kernel vs torch tree solve vs recurrences).
# Run from the repository root, in an environment with treeflash, CUDA torch and triton installed.
set -euo pipefail
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device"
import test_gdn
test_gdn.run_triton_cases("cuda")
print("triton tree kernel on", torch.cuda.get_device_name(), "matches the reference")
PY
python -m treeflash.cli gdn-bench --device cuda --tree-size 16,32,64,128 --repeats 10
python -m treeflash.cli gdn-bench --device cuda --tree-size 16,32,64,128 --repeats 10 --json > "${OUT:-.}/gdn_bench_cuda.json"
