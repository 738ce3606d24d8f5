"""TreeFlash's conditional normaliser on the CPU (`builders.TreeFlash.top_n`: each conditional is a softmax over the
depth's top-N marginal tokens), under the command line's defaults:

    python scripts/treeflash_top_n.py tau gsm8k,chat-dev     # tau at fixed budgets 4 / 8 / 16, N = M, 64, 512
    python scripts/treeflash_top_n.py speed gsm8k,chat-dev   # N = 512 against 64 at --budget auto and 4
    python scripts/treeflash_top_n.py build gsm8k            # the tables' time at B = 4 / 8 / 16, after an AR step

`speed` runs both in one process, alternating which goes first per prompt, two passes over 10 prompts; decode time
only (the prefill is the same for both). `build` times `conditional_tables` (the marginals' top N, the AR layer on
the D x M pairs, the N-column conditionals) for N = 512 and 64, and DDTree's top-B marginals for comparison, each
right after a target AR step (its caches as in a real round), medians of 40 interleaved. Each prints a line per
cell and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch

from treeflash.clock import now
from treeflash.drafters import make_drafter
from treeflash.drafters.builders import conditional_tables
from treeflash.engine import generate
from treeflash.eval.datasets import load_prompts
from treeflash.runtime import Target
from treeflash.tree import DraftTree


def tau(target, datasets: list[str]) -> dict:
    drafter = make_drafter("treeflash", target)
    out = {}
    for ds in datasets:
        prompts = [target.encode_prompt(p) for p in load_prompts(ds, limit=10)]
        for budget in (4, 8, 16):
            for n in (0, 64, 512):  # 0: N = M, the candidates themselves
                drafter.builder.top_n = n
                rounds = [r for p in prompts for r in generate(target, drafter, p, 128, budget=budget).rounds]
                out[f"{ds} B={budget} n={n}"] = sum(r.accepted for r in rounds) / len(rounds)
                print(f"{ds} B={budget} N={n or 'M'}: tau {out[f'{ds} B={budget} n={n}']:.4f}", flush=True)
    return out


def speed(target, datasets: list[str], passes: int = 2) -> dict:
    variants = {}
    for n in (512, 64):
        variants[n] = make_drafter("treeflash", target)
        variants[n].builder.top_n = n
    out = {}
    for ds in datasets:
        prompts = [target.encode_prompt(p) for p in load_prompts(ds, limit=10)]
        for budget in ("auto", 4):
            for drafter in variants.values():  # warm-up (and the policies' cost tables)
                generate(target, drafter, prompts[0], 16, budget=budget)
            sums = collections.defaultdict(lambda: [0.0, 0, 0])  # decode seconds, tokens after the first, rounds
            for rep in range(passes):
                for i, p in enumerate(prompts):
                    for n in list(variants)[::1 if (i + rep) % 2 == 0 else -1]:
                        r = generate(target, variants[n], p, 128, budget=budget)
                        s = sums[n]
                        s[0] += r.seconds - r.prefill_s
                        s[1] += len(r.tokens) - 1
                        s[2] += len(r.rounds)
            cell = {n: {"tok_s": s[1] / s[0], "tau": s[1] / s[2]} for n, s in sums.items()}
            cell["ratio_64_vs_512"] = cell[64]["tok_s"] / cell[512]["tok_s"]
            out[f"{ds} budget {budget}"] = cell
            print(ds, budget, json.dumps(cell), flush=True)
    return out


def build(target, datasets: list[str], repeats: int = 40) -> dict:
    drafter = make_drafter("treeflash", target)
    model, ar_layer = drafter.model, drafter.builder.ar_layer
    prompt = target.encode_prompt(load_prompts(datasets[0], limit=1)[0])
    drafter.observe(target.prefill(prompt, taps=drafter.taps).hidden)
    h = model.draft_states(5, drafter.ctx_len, drafter.context)
    tokens = prompt + [5]
    parts = {}
    for budget in (4, 8, 16):
        hb, m = h[:budget], min(32, budget)
        for n in (512, 64):
            parts[f"B={budget} tables N={n}"] = lambda hb=hb, m=m, n=n: conditional_tables(
                model, ar_layer, tokens, hb, m, n)
        parts[f"B={budget} ddtree's top-B marginals"] = lambda hb=hb, b=budget: model.top_tokens(hb, b)
    times = {name: [] for name in parts}
    with torch.no_grad():
        for _ in range(repeats):
            for name, f in parts.items():
                target.verify(DraftTree.chain(5))
                target.discard()
                start = now(target.device)
                f()
                times[name].append(now(target.device) - start)
    out = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    for name, ms in out.items():
        print(f"{name:35s} {ms:6.2f} ms")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["tau", "speed", "build"])
    p.add_argument("datasets", help="comma-separated, e.g. gsm8k,chat-dev")
    p.add_argument("--out")
    args = p.parse_args()
    target = Target.load(dtype="auto", compile="auto")  # the command line's defaults
    result = {"tau": tau, "speed": speed, "build": build}[args.what](target, args.datasets.split(","))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
