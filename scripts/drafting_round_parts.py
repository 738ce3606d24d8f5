"""Where a block drafter's drafting round goes on a CPU, each part timed right after a target AR step (the cache
state of a real round: the target's 4-bit weights have just streamed through it), every variant interleaved in one
loop so that machine drift hits them alike (issue 29, item 3).

    python scripts/drafting_round_parts.py --out docs/results/cheap-rounds/parts.json

The block forward is timed whole (γ positions) and cut to the rows a tree reads (what a drafter trained for short
blocks runs, `train dflash --short-blocks`), whatever the drafter's weights: the time depends on its shapes only.
Each forward is timed twice: on the drafter as the command line loads it (4-bit products where the target's are)
and on its trained bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from treeflash.clock import now
from treeflash.drafters import block_drafter, make_drafter
from treeflash.drafters.load import default_drafter_path, load_drafter_model
from treeflash.runtime.int4 import Int4Linear
from treeflash.eval.datasets import load_prompts
from treeflash.runtime import Target
from treeflash.tree import DraftTree


def products(model) -> str:
    """How a drafter's linears multiply: 4-bit or dense."""
    return "4-bit" if isinstance(model.layers[0].mlp.down_proj, Int4Linear) else "dense"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--drafter", help="a DFlash drafter folder (default: the shipped one)")
    p.add_argument("--out")
    args = p.parse_args()
    target = Target.load(dtype="auto", compile="auto")  # the command line's defaults
    drafter = make_drafter("ddtree", target, args.drafter)
    model = drafter.model
    prompt = target.encode_prompt(load_prompts("gsm8k", limit=1)[0])
    taps = target.prefill(prompt, taps=drafter.taps).hidden
    drafter.reset()
    drafter.observe(taps)
    one, position = taps[-1:], torch.tensor([len(prompt)])
    compiled = model.compiled_context

    def eager_catch_up():
        model.compiled_context = None
        model.context_states(one, position)
        model.compiled_context = compiled

    def ar_step():
        target.verify(DraftTree.chain(5))
        target.discard()

    parts = {"ar step (verify, no commit)": ar_step, "catch-up of 1 position, eager": eager_catch_up}

    def block(m, depth: int, short: bool) -> None:
        trained, m.config.short_blocks = m.config.short_blocks, short
        m.draft_states(5, drafter.ctx_len, drafter.context, depth)
        m.config.short_blocks = trained

    g = model.config.block_size
    # the drafter as the command line loads it (4-bit where the target is), and with its trained weights (bf16)
    dense = load_drafter_model(target, args.drafter or default_drafter_path(target.name, "dflash"), int4_products=False)
    for label, m in ((products(model), model), (products(dense), dense)):
        parts[f"catch-up of 1 position, compiled, {label}"] = lambda m=m: m.context_states(one, position)
        for depth in (15, 8, 4, 2):
            parts[f"block forward, {g} positions, states of {depth}, {label}"] = lambda m=m, d=depth: block(m, d, False)
            if depth + 1 < g:
                parts[f"block forward, {depth + 1} positions (short), {label}"] = lambda m=m, d=depth: block(m, d, True)
    h = model.draft_states(5, drafter.ctx_len, drafter.context)
    for label, d in ((products(model), drafter), (products(dense), block_drafter(dense, "ddtree"))):
        for budget in (2, 4, 16):  # its LM-head rows are 4-bit where its linears are
            parts[f"ddtree tree build, budget {budget}, {label}"] = lambda d=d, b=budget: d.tree(prompt + [5], h, b)
    times = {name: [] for name in parts}
    with torch.no_grad():
        for f in parts.values():
            f(), f()
        for _ in range(args.repeats):
            for name, f in parts.items():
                ar_step()
                start = now(target.device)
                f()
                times[name].append(now(target.device) - start)
    medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    step = medians["ar step (verify, no commit)"]
    for name, ms in medians.items():
        print(f"{name:50s} {ms:6.2f} ms  {ms / step:5.2f}x the AR step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ms": medians, "repeats": args.repeats, "prompt_tokens": len(prompt),
                       "drafter": args.drafter or "shipped"}, f, indent=1)


if __name__ == "__main__":
    main()
