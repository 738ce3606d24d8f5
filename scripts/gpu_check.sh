#!/usr/bin/env bash
# GPU check (about 10 minutes on one GPU), run from the repository root in an environment with treeflash, CUDA
# torch and triton installed; what it writes goes to $OUT (default: the current folder).
# 1. The GDN tree kernel: Triton compiled for CUDA against the per-branch reference, then `treeflash gdn-bench`.
# 2. The engine on CUDA: the static runtime against the HF reference (the tests' equality checks, on the device),
#    then every method with --budget auto against transformers' generate, in one bench run (bf16 where native).
set -euo pipefail
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
OUT="${OUT:-.}"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device"
import test_gdn
test_gdn.run_triton_cases("cuda")
print("triton tree kernel on", torch.cuda.get_device_name(), "matches the reference")
PY
python -m treeflash.cli gdn-bench --device cuda --tree-size 16,32,64,128 --repeats 10 --json > "$OUT/gdn_bench_cuda.json"
python - <<'PY'
import random
import torch
from treeflash import DraftTree, Target

# the static runtime against the HF runtime on the real target, on CUDA, fp32
ref = Target.load("smollm2-135m-instruct", dtype="float32", device="cuda", runtime="hf")
fast = Target.load("smollm2-135m-instruct", dtype="float32", device="cuda", runtime="static")
rng = random.Random(0)
prompt = fast.encode_prompt("Explain speculative decoding.")
for t in (fast, ref):
    t.prefill(prompt, taps=(1, 8, 15, 22, 29))
worst = 0.0
for _ in range(8):
    tokens, parents = [rng.randrange(49152)], [-1]
    for i in range(1, 17):
        tokens.append(rng.randrange(49152)); parents.append(rng.randrange(i))
    tree = DraftTree.from_parents(tokens, parents)
    a, b = fast.verify(tree), ref.verify(tree)
    worst = max(worst, (a.logits - b.logits).abs().max().item(), (a.hidden - b.hidden).abs().max().item())
    path = tree.path_to(rng.randrange(len(tree)))
    fast.commit(path); ref.commit(path)
print(f"static vs hf runtime on CUDA: max abs difference {worst:.2e}")
assert worst < 1e-2
PY
python -m treeflash.cli bench --device cuda --dtype auto --budget auto --limit 10 --max-new-tokens 128 \
    --methods ar,pld,dflash,ddtree,treeflash,tfm,hf,hf-pld --no-progress --out "$OUT/bench_cuda_auto.json"
python -m treeflash.cli bench --device cuda --dtype float32 --budget auto --limit 5 --max-new-tokens 128 \
    --methods ar,ddtree,treeflash,tfm --no-progress --out "$OUT/bench_cuda_fp32.json"
