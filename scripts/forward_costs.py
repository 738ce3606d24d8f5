"""Where a round's time goes on the default target, per verified row count, against the products' floor.

For n verified tokens (a chain and a bushy tree): the target's verify (forward, no accept / commit) on the GGUF's
int4 kernels (eager, and compiled: `--compile`), on the dense bf16 weights, and the products alone (every int4
product of one forward at n rows, timed back to back: what the forward cannot go below with these kernels). Then
one drafting round of each block drafter, eager and compiled (its forward and tree at B = 8, without and with the
catch-up of 16 new positions), and the round's bookkeeping (tree, mask, acceptance, commit) on the int4 runtime.

    .venv/bin/python scripts/forward_costs.py [--out costs.json]
"""

import argparse
import json
import statistics
import time

import torch

from treeflash import DraftTree, Sampling, Target
from treeflash.drafters import make_drafter
from treeflash.runtime.int4 import Int4Linear
from treeflash.verify import accept

ROWS = (1, 2, 3, 4, 6, 8, 12, 17)
REPEATS = 15


def timed(fn, repeats: int = REPEATS) -> float:
    """Median milliseconds of fn() after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bushy(root: int, n: int) -> DraftTree:
    parents = [-1] + [max(0, (i - 1) // 2) for i in range(1, n)]
    return DraftTree.from_parents([root] + [100 + i for i in range(1, n)], parents)


def verify_ms(target: Target, context: list[int], tree: DraftTree) -> float:
    target.prefill(context)

    def run():
        target.verify(tree)
        target.discard()
    return timed(run)


def products_ms(target: Target, n: int) -> float:
    """Every 4-bit product of one forward at n rows (the fused modules the static runtime calls), back to back."""
    fused = [p.int4 for layer in target.static.layers for p in layer.projections]
    head = target.static.lm_head.int4
    xs = {m.in_features: torch.randn(n, m.in_features, dtype=target.dtype) for m in fused}

    def run():
        with torch.inference_mode():
            for m in fused:
                m(xs[m.in_features])
            head(xs[head.in_features])  # a verify scores every row
    return timed(run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    int4 = Target.load(dtype="bfloat16")  # the command line's default here: the GGUF's own blocks
    compiled = Target.load(dtype="bfloat16", compile="on")  # ... and its default compiled layer
    dense = Target.load(dtype="bfloat16", quantize="none")
    assert isinstance(int4.static.lm_head.int4, Int4Linear)
    prompt = int4.encode_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                                "clips in May. How many clips did Natalia sell altogether?")
    context = (prompt * 8)[:200]
    rows = []
    for n in ROWS:
        chain = DraftTree.chain(context[-1], context[:n - 1])
        row = {"rows": n, "int4_chain_ms": verify_ms(int4, context[:-1], chain),
               "int4_tree_ms": verify_ms(int4, context[:-1], bushy(context[-1], n)),
               "int4_compiled_chain_ms": verify_ms(compiled, context[:-1], chain),
               "int4_compiled_tree_ms": verify_ms(compiled, context[:-1], bushy(context[-1], n)),
               "dense_bf16_chain_ms": verify_ms(dense, context[:-1], chain),
               "int4_products_ms": products_ms(int4, n)}
        rows.append(row)
        print(json.dumps(row))
    head = int4.static.lm_head.int4  # its share of the products
    head_ms = {n: timed(lambda: head(torch.randn(n, head.in_features, dtype=int4.dtype))) for n in (1, 4, 17)}

    drafting = {}
    for method in ("dflash", "ddtree", "treeflash", "tfm"):
        drafting[method] = {}
        for prefix, target in (("", int4), ("compiled_", compiled)):  # the drafter compiles with its target
            drafter = make_drafter(method, target)
            out = target.prefill(context[:-16], taps=drafter.taps)
            drafter.reset()
            tokens = context[:-16] + [context[-16]]
            drafter.propose(tokens, out.hidden, 8)
            warm = timed(lambda: drafter.propose(tokens, None, 8))
            # with the catch-up of 16 committed positions (what a probe after AR steps pays): fresh contexts
            feats = target.prefill(context[:-1], taps=drafter.taps).hidden

            def caught_up():
                drafter.reset()
                drafter.propose(context[:-16] + [context[-16]], feats[:-15], 8)  # the context up to the catch-up
                start = time.perf_counter()
                drafter.propose(context, feats[-15:], 8)
                return time.perf_counter() - start
            caught_up()
            catch = 1e3 * statistics.median([caught_up() for _ in range(REPEATS)])
            drafting[method].update({f"{prefix}propose_ms": warm, f"{prefix}propose_after_15_new_positions_ms": catch})
        print(method, json.dumps(drafting[method]))

    # bookkeeping: a 9-node tree's mask, positions, acceptance and commit, without the forward
    tree = bushy(context[-1], 9)
    int4.prefill(context[:-1])
    logits = int4.verify(tree).logits
    int4.discard()

    def bookkeeping():
        tree.ancestor_mask(), tree.positions(int4.length)
        path, _ = accept(tree, logits, Sampling())
        int4.static.cache.keep(0, int4.length, path)
    book = timed(bookkeeping)
    ar_step = rows[0]["int4_compiled_chain_ms"]  # the command line's AR step
    report = {"verify": rows, "lm_head_ms": head_ms, "drafting": drafting, "bookkeeping_9_nodes_ms": book,
              "ar_step_ms": ar_step, "threads": torch.get_num_threads(), "weights": int4.weights.as_dict()}
    print(f"AR step (1-row verify) {ar_step:.2f} ms; bookkeeping of a 9-node round {book:.2f} ms; LM head "
          + ", ".join(f"{n} rows {ms:.2f} ms" for n, ms in head_ms.items()))
    for method, d in drafting.items():
        for prefix, label in (("", "eager"), ("compiled_", "compiled")):
            ms = d[f"{prefix}propose_ms"]
            print(f"{method}: drafting round, {label} drafter, {ms:.2f} ms = {ms / ar_step:.2f} x an AR step "
                  f"({d[f'{prefix}propose_after_15_new_positions_ms']:.2f} ms after 15 new positions)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
