"""One step of the GPU check (scripts/gpu_check.sh runs each under its own timeout); each writes STEP.json to --out.

  versions     what runs: Python, torch, CUDA, the GPU, transformers, triton
  triton       the Triton GDN tree kernel, compiled, against the per-branch reference
  correctness  a random-initialised Qwen3 with Qwen3-8B's shapes (GQA 4:1, head dim 128, vocab 151,936) and two
               layers, fp32: static vs HF runtime on trees and on an uneven batch; every method's tokens equal to
               `ar`, alone and batched, eager and with CUDA graphs; `ar` equal to transformers' greedy `generate`
  speed        a random Qwen3-8B (36 layers) in bf16: prefill 4 K, the engine's overhead; then eager and with CUDA
               graphs (`--compile`): verify latency at 1/17/65/257 tokens, times, kernels and host syncs per round,
               batches of 8 and 32
  train        one DFlash training step at Qwen3-8B width (target forward, drafter forward/backward, AdamW), peak
               memory

`--small --device cpu` runs every step at toy sizes: the CPU tests keep this script working.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
SMALL = dict(QWEN3_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' kernel cases and prompts
# fp32 on both runtimes: different products (fused q|k|v, other GEMM shapes) round differently, about 1e-5 here
LOGIT_TOLERANCE = 1e-3


def random_qwen3(shape: dict, layers: int, dtype: torch.dtype, device: str, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**shape, "num_hidden_layers": layers}, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on its device: no fp32 copy of 8 B parameters on the host
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn` (the device synchronised around each call)."""
    from treeflash.clock import now

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = now(device)
        fn()
        times.append(now(device) - t0)
    return statistics.median(times)


# ---- steps -----------------------------------------------------------------------------------------------------
def versions(args) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "device": args.device,
            "commit": os.environ.get("TREEFLASH_COMMIT", "unknown")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported())
    return info


def triton_kernel(args) -> dict:
    import test_gdn

    test_gdn.run_triton_cases(args.device)  # raises where it differs
    return {"matches_reference": True, "cases": len(test_gdn.TRITON_CASES)}


def random_drafters(target, folder: Path, block_size: int = 8) -> dict[str, dict]:
    """Every block method's drafter, random-initialised for `target` and saved as a user's would be: the paths
    make_drafter reads."""
    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash2 import DFlash2Config, DFlash2Drafter
    from treeflash.models.dflash_config import DFlashConfig
    from treeflash.models.weaver import Weaver, WeaverConfig

    c, mask = target.config, target.config.vocab_size - 1
    torch.manual_seed(1)
    config = DFlashConfig.for_target(c, num_layers=1, num_taps=2, block_size=block_size, mask_token_id=mask)
    backbone = DFlashDrafter(config).attach(target.model)
    backbone.save_pretrained(folder / "dflash")
    torch.manual_seed(2)
    treeflash = DFlashDrafter(config).attach(target.model).add_ar_layer("swiglu", 1)
    torch.nn.init.normal_(treeflash.ar_layer.d.weight, std=0.02)  # zero-initialised: it would change nothing
    treeflash.save_pretrained(folder / "treeflash")
    weaver = Weaver(WeaverConfig.for_drafter(config, top_k=12)).attach(backbone)
    torch.nn.init.normal_(weaver.out_proj.weight, std=0.02)
    weaver.save_pretrained(folder / "weaver")
    torch.manual_seed(3)
    dflash2 = DFlash2Drafter(DFlash2Config.for_target(c, conv_kernel_size=3, conv_group_size=16, selector_rank=16,
                                                      selector_top_k=6, num_layers=1, num_taps=2,
                                                      block_size=block_size, mask_token_id=mask))
    dflash2.save_pretrained(folder / "dflash2")
    paths = {"ar": {}, "pld": {}, "dflash": {"drafter_path": folder / "dflash"},
             "ddtree": {"drafter_path": folder / "dflash"}, "treeflash": {"drafter_path": folder / "treeflash"},
             "tfm": {"drafter_path": folder / "dflash", "weaver_path": folder / "weaver"},
             "dflash2": {"drafter_path": folder / "dflash2"}, "dflash2-tree": {"drafter_path": folder / "dflash2"}}
    return {m: {k: str(v) for k, v in kw.items()} for m, kw in paths.items()}


def correctness(args) -> dict:
    from treeflash import Target, generate
    from treeflash.batching import BatchEngine, BatchTarget
    from treeflash.drafters import make_drafter
    from treeflash.tree import random_tree

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products in fp32: the exact path
    torch.backends.cudnn.allow_tf32 = False
    shape = SMALL if args.small else QWEN3_8B
    model = random_qwen3(shape, 2, torch.float32, args.device)
    fast, ref = Target(model, name="random-qwen3", runtime="static"), Target(model, name="random-qwen3", runtime="hf")
    vocab, rng = shape["vocab_size"], random.Random(0)
    report: dict = {"shape": {**shape, "num_hidden_layers": 2}, "dtype": "float32", "tolerance": LOGIT_TOLERANCE}

    # trees over one sequence: logits and taps of both runtimes, then a random path committed on both
    history = [rng.randrange(vocab) for _ in range(300)]
    for t in (fast, ref):
        t.prefill(history, taps=(0, 1))
    worst = 0.0
    for size in (17, 65, 17, 65, 257, 2):
        tree = random_tree(rng, vocab, size, rng.randrange(vocab))
        a, b = fast.verify(tree), ref.verify(tree)
        worst = max(worst, (a.logits - b.logits).abs().max().item(), (a.hidden - b.hidden).abs().max().item())
        path = tree.path_to(rng.randrange(len(tree)))
        fast.commit(path)
        ref.commit(path)
    report["trees_max_abs_diff"] = worst

    # an uneven batch (three lengths, trees of different sizes) against each sequence alone on the HF runtime
    histories = [[rng.randrange(vocab) for _ in range(n)] for n in (40, 171, 302)]
    batch, worst = BatchTarget(fast, 3), 0.0
    for h in histories:
        worst = max(worst, (batch.add(h).logits - ref.prefill(h).logits).abs().max().item())
    for _ in range(3):
        trees = [random_tree(rng, vocab, rng.choice((1, 9, 33)), rng.randrange(vocab)) for _ in histories]
        outs, paths = batch.verify(trees), []
        for h, tree, out in zip(histories, trees, outs):
            ref.prefill(h)
            worst = max(worst, (out.logits - ref.verify(tree).logits).abs().max().item())
            paths.append(tree.path_to(rng.randrange(len(tree))))
            h += [tree.tokens[i] for i in paths[-1]]
        batch.commit(paths)
    report["uneven_batch_max_abs_diff"] = worst
    ok = report["trees_max_abs_diff"] < LOGIT_TOLERANCE and worst < LOGIT_TOLERANCE

    # every method against ar, alone and batched; ar against transformers' generate (an outside reference); then
    # again with the verification forwards in fixed shapes (`--compile` on CUDA: CUDA graphs; on a CPU: eagerly)
    n = 24 if args.small else 32
    from test_lossless import repetitive_prompt

    prompts = [repetitive_prompt(random.Random(s), vocab, length) for s, length in ((1, 64), (2, 40), (3, 97))]
    ars = [generate(fast, make_drafter("ar"), p, n).tokens for p in prompts]
    hf = model.generate(torch.tensor([prompts[0]], device=model.device), max_new_tokens=n, do_sample=False,
                        min_new_tokens=n, pad_token_id=0)[0, len(prompts[0]):].tolist()
    report["ar_equals_transformers_generate"] = hf == ars[0]
    ok &= hf == ars[0]
    with tempfile.TemporaryDirectory() as tmp:
        paths = random_drafters(fast, Path(tmp))
        for mode in ("eager", "graphs"):
            if mode == "graphs":
                if args.device == "cuda":
                    fast.compile("on")
                else:
                    fast.static.use_graphs(capture=False)
            methods = report["methods" if mode == "eager" else "methods_graphs"] = {}
            for method, kw in paths.items():
                drafter = make_drafter(method, fast, **kw)
                single = generate(fast, drafter, prompts[0], n, budget=16)
                batched = BatchEngine(fast, drafter, max_batch=2, budget=16).run(prompts, n)
                row = methods[method] = {"single_equal": single.tokens == ars[0], "tau": round(single.tau, 3),
                                         "batched_equal": [r.tokens == a for r, a in zip(batched, ars)]}
                if single.tokens != ars[0]:  # a flip: how close the target's top two were at the first difference
                    i = next(i for i, (x, y) in enumerate(zip(single.tokens, ars[0])) if x != y)
                    logits = ref.prefill(prompts[0] + ars[0][:i]).logits[-1].float()
                    top = logits.topk(2).values
                    row["first_difference"] = {"at": i, "top2_margin": (top[0] - top[1]).item()}
                ok &= row["single_equal"] and all(row["batched_equal"])
    report["graphs_captured"] = fast.compiled
    report["ok"] = bool(ok)
    return report


def speed(args) -> dict:
    from treeflash import Target, generate
    from treeflash.drafters import make_drafter
    from treeflash.eval.overhead import measure_overhead
    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash_config import DFlashConfig

    shape = SMALL if args.small else QWEN3_8B
    device, dtype = torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = random_qwen3(shape, shape["num_hidden_layers"], dtype, args.device)
    target = Target(model, name="random-qwen3-8b", runtime="static")
    vocab, rng = shape["vocab_size"], random.Random(0)
    context = 512 if args.small else 4096
    report: dict = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "build_s": time.perf_counter() - t0,
                    "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9}
    if device.type == "cuda":
        report["weights_gib"] = torch.cuda.memory_allocated() / 2**30
    prompt = [rng.randrange(vocab) for _ in range(context)]
    prefill_s = timed(lambda: target.prefill(prompt), device, repeats=3, warmup=1)
    report["prefill"] = {"tokens": context, "ms": 1e3 * prefill_s, "tokens_per_s": context / prefill_s}
    report["overhead"] = measure_overhead(target, context=200, repeats=5)
    torch.manual_seed(1)  # a random DFlash drafter of the published Qwen3-8B size: 5 layers, block 16
    config = DFlashConfig.for_target(target.config, num_layers=5, num_taps=5, block_size=16, mask_token_id=vocab - 1)
    dflash = DFlashDrafter(config).attach(target.model).to(device, dtype)

    # the same measurements eager, then with the verification forwards as CUDA graphs (`--compile`: graphed.py)
    report["eager"] = engine_costs(target, dflash, prompt, random.Random(1))
    eager_ar = generate(target, make_drafter("ar"), prompt[:512], 32).tokens
    if device.type == "cuda" and target.compile("on"):
        report["graphs"] = engine_costs(target, dflash, prompt, random.Random(1))
        graphed = generate(target, make_drafter("ar"), prompt[:512], 32).tokens
        report["graphs"]["ar_tokens_equal_eager"] = graphed == eager_ar  # bf16: a near-tie may flip
        report["graphs"]["captured_forwards"] = len(target.static.cache.graphs)
    if device.type == "cuda":
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return report


def engine_costs(target, dflash, prompt: list[int], rng: random.Random) -> dict:
    """Verification of 1/17/65/257 tokens after the prompt; decoding rounds (ar, ddtree at budgets 16 and 64)
    after its first 512 positions: times, host syncs, kernels; batches of 8 and 32 sequences."""
    from treeflash import generate
    from treeflash.batching import BatchEngine
    from treeflash.drafters import block_drafter, make_drafter
    from treeflash.eval.syncs import count_syncs
    from treeflash.tree import random_tree

    device, vocab = target.device, target.config.vocab_size
    target.prefill(prompt)
    trees = {size: random_tree(rng, vocab, size, prompt[-1]) for size in (1, 17, 65, 257)}

    def verify_once(tree):
        target.verify(tree)
        target.discard()
    verify = {size: {"ms": 1e3 * timed(lambda t=tree: verify_once(t), device, repeats=10)}
              for size, tree in trees.items()}
    # times from a plain run, host syncs counted in a second (CUDA's sync debug mode slows it down), kernels
    # profiled last (a profiler run can leave launches slower)
    short, new = prompt[:512], 17
    runs = {"ar": (make_drafter("ar"), 1), "ddtree@16": (block_drafter(dflash, "ddtree"), 16),
            "ddtree@64": (block_drafter(dflash, "ddtree"), 64)}
    rounds = {}
    for name, (drafter, budget) in runs.items():
        generate(target, drafter, short, 4, budget=budget)  # warm-up (with graphs: their capture)
        result = generate(target, drafter, short, new, budget=budget)
        with count_syncs() as syncs:
            generate(target, drafter, short, new, budget=budget)
        n = len(result.rounds)
        rounds[name] = {"rounds": n, "draft_ms": 1e3 * statistics.median(r.draft_s for r in result.rounds),
                        "verify_ms": 1e3 * statistics.median(r.verify_s for r in result.rounds),
                        "explicit_syncs_per_round": syncs.explicit / n, "implicit_syncs_per_round": syncs.implicit / n}
    batches = {}
    for size in (8, 32):
        prompts = [[rng.randrange(vocab) for _ in range(512)] for _ in range(size)]
        row = {}
        for name, drafter, budget in (("ar", make_drafter("ar"), 1),
                                      ("ddtree@16", block_drafter(dflash, "ddtree"), 16)):
            engine = BatchEngine(target, drafter, max_batch=size, budget=budget)
            engine.run(prompts, 2)  # warm-up at this batch size
            engine.rounds, engine.draft_s, engine.verify_s = 0, 0.0, 0.0
            results = engine.run(prompts, 16)
            seconds = engine.draft_s + engine.verify_s
            row[name] = {"round_ms": 1e3 * seconds / engine.rounds,
                         "tokens_per_s": sum(len(r.tokens) - 1 for r in results) / seconds}
        batches[size] = row
    target.prefill(prompt)
    for size, tree in trees.items():
        verify[size].update(kernel_stats(lambda t=tree: verify_once(t), device))
    for name, (drafter, budget) in runs.items():
        kernels = kernel_stats(lambda: generate(target, drafter, short, new, budget=budget), device)
        rounds[name]["kernels_per_round"] = kernels["kernels"] / rounds[name]["rounds"]
    return {"verify": verify, "rounds": rounds, "batches": batches}


def kernel_stats(fn, device: torch.device) -> dict:
    """Kernels launched by one call of `fn` and the time they ran on the device (CUDA only: none on the CPU)."""
    if device.type != "cuda":
        return {"kernels": 0, "kernel_ms": 0.0}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels": len(kernels), "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3}


def train_step(args) -> dict:
    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash_config import DFlashConfig
    from treeflash.train.dflash import Sequence, dflash_loss, sample_anchors, target_view

    shape = SMALL if args.small else QWEN3_8B
    device = torch.device(args.device)
    bf16 = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_qwen3(shape, shape["num_hidden_layers"], bf16, args.device)
    config = DFlashConfig.for_target(model.config, num_layers=5, num_taps=5, block_size=16,
                                     mask_token_id=shape["vocab_size"] - 1)
    torch.manual_seed(1)
    drafter = DFlashDrafter(config).attach(model).to(device)  # fp32 weights, bf16 autocast: the training recipe
    drafter.requires_grad_(False)
    trainable = [p for n, p in drafter.named_parameters() if not n.startswith(("embed", "lm_head"))]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    length, anchors = (256, 32) if args.small else (2048, 512)
    gen = torch.Generator().manual_seed(0)
    seq = Sequence(torch.randint(shape["vocab_size"], (length,), generator=gen), 128)
    taps = config.target_layer_ids

    def step() -> float:
        view = target_view(model, seq.tokens, taps)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = dflash_loss(drafter, seq, view, sample_anchors(seq, anchors, gen))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, device, repeats=3, warmup=1)
    report = {"target": {**shape}, "drafter_parameters_m": sum(p.numel() for p in trainable) / 1e6,
              "sequence": length, "anchors": anchors, "block_size": config.block_size, "seconds_per_step": seconds,
              "loss": step()}
    if device.type == "cuda":
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return report


STEPS = {"versions": versions, "triton": triton_kernel, "correctness": correctness, "speed": speed,
         "train": train_step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=list(STEPS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (a dry run of the same code on a CPU)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for STEP.json ($OUT)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    report = STEPS[args.step](args)
    report["step_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=1, default=str)
    Path(args.out, f"{args.step}.json").write_text(text + "\n")
    print(text)
    return 0 if report.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
