"""`treeflash bench --batch-size N[,M...]`: throughput of batched decoding (batching.BatchEngine).

Every variant (method x budget) decodes all the prompts at every batch size, up to N at a time with continuous
batching (a finished sequence's slot goes to the next prompt between rounds), and reports the total new tokens per
second of the whole run, against `ar` at the same batch size and against its own batch size 1. Exactness is per
sequence, against the single-sequence AR decoding of its prompt (in bf16 batched rounding can flip a near-tie:
`prompts_matching_ar` counts them). The runs are interleaved by repetition, so that noise hits all alike.
"""

from __future__ import annotations

from tqdm import tqdm

from ..batching import BatchEngine
from ..clock import now
from ..drafters import make_drafter
from ..engine import AUTO, DEFAULT_MAX_BUDGET, generate
from ..runtime import Target
from ..verify import Sampling
from .baselines import BASELINES
from .bench import EAGER


def run_batch_bench(target: Target, prompts: list[str], methods: list[str], batch_sizes: list[int],
                    budgets: list = (AUTO,), sampling: Sampling = Sampling(), max_new_tokens: int = 128,
                    seed: int = 0, progress: bool = True, drafter_path: str | None = None,
                    weaver_path: str | None = None, tfm_width: int = 8, max_budget: int = DEFAULT_MAX_BUDGET,
                    draft_vocab_size: int | None = None, repeats: int = 1,
                    datastore_path: str | None = None) -> dict:
    encoded = [target.encode_prompt(p) for p in prompts]
    ar_drafter = make_drafter("ar")
    reference = [generate(target, ar_drafter, p, max_new_tokens).tokens for p in encoded] if sampling.greedy else None
    variants = [("ar", 1)] + [(m, b) for m in methods if m not in ("ar", EAGER, *BASELINES) for b in budgets]
    drafters = {m: make_drafter(m, target, drafter_path, weaver_path, tfm_width, draft_vocab_size, datastore_path)
                for m in dict.fromkeys(m for m, _ in variants)}
    engines = {(m, b, n): BatchEngine(target, drafters[m], n, b, max_budget)  # measures the batch costs once
               for m, b in variants for n in batch_sizes}
    for engine in engines.values():  # warm-up: first calls pay for allocations and lazy initialisation
        engine.run(encoded[:engine.slots.max_batch], 8, sampling, seed)

    stats = {key: {"tokens": 0, "seconds": 0.0, "rounds": 0, "committed": 0, "nodes": 0, "ar_rounds": 0,
                   "batch_rounds": 0, "draft_s": 0.0, "verify_s": 0.0, "outputs": None}
             for key in engines}
    bar = tqdm(total=len(engines) * repeats, desc="batch bench", unit="run", disable=not progress, leave=False)
    for _ in range(repeats):
        for key, engine in engines.items():
            start, rounds, draft_s, verify_s = now(target.device), engine.rounds, engine.draft_s, engine.verify_s
            results = engine.run(encoded, max_new_tokens, sampling, seed)
            s = stats[key]
            s["batch_rounds"] += engine.rounds - rounds
            s["draft_s"] += engine.draft_s - draft_s
            s["verify_s"] += engine.verify_s - verify_s
            s["seconds"] += now(target.device) - start
            s["tokens"] += sum(len(r.tokens) for r in results)
            rounds = [x for r in results for x in r.rounds]
            s["rounds"] += len(rounds)
            s["nodes"] += sum(x.tree_size for x in rounds)
            s["ar_rounds"] += sum(x.tree_size == 0 for x in rounds)
            s["committed"] += sum(x.accepted for x in rounds)
            s["outputs"] = [r.tokens for r in results]
            bar.update()
    bar.close()

    report = {}
    for (m, b, n), s in stats.items():
        tps = s["tokens"] / s["seconds"]
        name = m if m == "ar" else f"{m}@{b}"
        ar_tps = stats["ar", 1, n]["tokens"] / stats["ar", 1, n]["seconds"]
        own1 = stats.get((m, b, 1))
        report[f"{name} B={n}"] = {
            "method": m, "budget": None if m == "ar" else b, "batch_size": n,
            "tokens_per_second": tps,  # all sequences together
            "speedup_vs_ar": tps / ar_tps,  # batched AR at the same batch size
            "speedup_vs_batch_1": None if own1 is None else tps / (own1["tokens"] / own1["seconds"]),
            "tau": s["committed"] / max(s["rounds"], 1),  # per sequence and round
            "mean_tree_size": s["nodes"] / max(s["rounds"], 1),
            "mean_batch": s["rounds"] / max(s["batch_rounds"], 1),  # sequences per round (the tail runs fewer)
            "draft_ms_per_round": 1e3 * s["draft_s"] / max(s["batch_rounds"], 1),  # the whole batch's turn
            "verify_ms_per_round": 1e3 * s["verify_s"] / max(s["batch_rounds"], 1),
            "ar_round_share": s["ar_rounds"] / max(s["rounds"], 1),
            "matches_ar": None if reference is None else s["outputs"] == reference,
            "prompts_matching_ar": None if reference is None else sum(o == r for o, r in zip(s["outputs"], reference)),
            "num_prompts": len(encoded),
            "new_tokens": s["tokens"] // repeats,
        }
    return report


def format_batch_table(report: dict) -> str:
    head = (f"{'variant':<18} {'tok/s':>7} {'vs ar':>7} {'vs B=1':>7} {'tau':>5} {'size':>5} {'AR %':>5} "
            f"{'batch':>5} {'draft ms':>8} {'verify ms':>9} {'matches_ar':>10}")
    lines = [head, "-" * len(head)]
    for name, r in report.items():
        match = "-" if r["matches_ar"] is None else f"{r['prompts_matching_ar']}/{r['num_prompts']}"
        vs1 = "-" if r["speedup_vs_batch_1"] is None else f"{r['speedup_vs_batch_1']:.2f}x"
        lines.append(f"{name:<18} {r['tokens_per_second']:>7.1f} {r['speedup_vs_ar']:>6.2f}x {vs1:>7} "
                     f"{r['tau']:>5.2f} {r['mean_tree_size']:>5.1f} {100 * r['ar_round_share']:>5.1f} "
                     f"{r['mean_batch']:>5.1f} {r['draft_ms_per_round']:>8.1f} {r['verify_ms_per_round']:>9.1f} "
                     f"{match:>10}")
    return "\n".join(lines)
