"""`treeflash dist`: how far the drafter's distributions are from the target's, depth by depth.

Along the target's own continuation of each prompt (greedy, or sampled at `temperature`), every position is an
anchor; at depth d the drafter's distribution for the token d steps ahead is compared with the target's
(teacher-forced) distribution there: total-variation distance (to the target's plain softmax, the one drafters
are trained on), and top-k coverage, the probability that the target's token is among the drafter's k most likely:
at T = 0 whether the target's argmax is, at T > 0 the mass of the target's tempered distribution on them. The
DFlash marginals and, for a TreeFlash drafter, the AR layer's conditionals (given the true previous token) are
measured on the same anchors; with a Weaver, its conditionals too (given the true branch, as in training).

The Weaver has a distribution over its K candidates only (the top-K of the DFlash marginal at that depth); it is
compared over the full vocabulary as it is used to build trees: its probabilities placed on the K candidates and
zero mass on every other token (so the target's mass outside the candidates counts fully in its TVD).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..drafters import make_drafter
from ..engine import generate
from ..models.dflash import DFlashDrafter
from ..models.weaver import Weaver
from ..runtime import Target
from ..verify import Sampling
from ..train.dflash import Sequence, drafted_positions, target_view
from ..train.weaver import weaver_logits

COVERAGE_K = (1, 5)


@torch.no_grad()
def depth_stats(drafter: DFlashDrafter, seq: Sequence, target_logp: torch.Tensor, taps: torch.Tensor,
                kind: str, chunk: int = 32, weaver: Weaver | None = None,
                temperature: float = 0.0) -> dict[str, torch.Tensor]:
    """Sums over all anchors of the answer, per depth 1..γ-1: TVD, top-k hits, and the anchors counted.
    kind: "dflash" (marginals), "treeflash" (AR-layer conditionals) or "weaver" (`weaver`'s conditionals)."""
    parts = [_anchor_stats(drafter, seq, target_logp, taps, kind, a, weaver, temperature)
             for a in torch.arange(seq.prompt_len, len(seq.tokens) - 1, device=seq.tokens.device).split(chunk)]
    return {k: sum(p[k] for p in parts) for k in parts[0]}


def _anchor_stats(drafter, seq, target_logp, taps, kind, anchors, weaver, temperature) -> dict[str, torch.Tensor]:
    g, S = drafter.config.block_size, len(seq.tokens)
    predicted = drafted_positions(anchors, g)
    valid = predicted < S
    if kind == "weaver":  # its distribution on the K candidates, zero elsewhere
        _, cand, logits, _ = weaver_logits(weaver, drafter, seq.tokens, taps, anchors)
        q = torch.zeros(*cand.shape[:-1], drafter.config.vocab_size, device=cand.device)
        q = q.scatter(-1, cand, torch.softmax(logits.float(), dim=-1))  # [N, γ-1, V]
    else:
        prev = None
        if kind == "treeflash":
            back = torch.arange(drafter.ar_layer.prev_tokens, 0, -1, device=seq.tokens.device)
            prev = seq.tokens[(predicted[:, :, None] - back).clamp(max=S - 1)]
        h = drafter(anchors, seq.tokens, taps, prev)
        q = torch.softmax(drafter.logits(h).float(), dim=-1)  # [N, γ-1, V]
    logp = target_logp[(predicted - 1).clamp(max=S - 1)]
    p = logp.exp()
    out = {"tvd": (0.5 * (p - q).abs().sum(-1) * valid).sum(0), "count": valid.sum(0).float()}
    ranks = q.topk(max(COVERAGE_K), dim=-1).indices
    decoded = Sampling(temperature).probs(logp) if temperature > 0 else None  # what the target draws from
    for k in COVERAGE_K:
        if decoded is None:  # greedy: is the target's argmax among the drafter's top k
            hit = (ranks[..., :k] == p.argmax(-1, keepdim=True)).any(-1).float()
        else:
            hit = decoded.gather(-1, ranks[..., :k]).sum(-1)
        out[f"top{k}"] = (hit * valid).sum(0)
    return out


def distribution_metrics(target: Target, drafter: DFlashDrafter, prompts: list[str], max_new_tokens: int = 128,
                         progress: bool = True, weaver: Weaver | None = None, temperature: float = 0.0,
                         seed: int = 0) -> dict:
    kinds = ["dflash"] + (["treeflash"] if drafter.ar_layer is not None else []) + (["weaver"] if weaver else [])
    totals: dict[str, dict[str, torch.Tensor]] = {}
    for i, text in enumerate(tqdm(prompts, desc="dist", disable=not progress, leave=False)):
        prompt = target.encode_prompt(text)
        answer = generate(target, make_drafter("ar"), prompt, max_new_tokens, Sampling(temperature),
                          seed=seed + i).tokens
        seq = Sequence(torch.tensor(prompt + answer, device=target.device), len(prompt))
        view = target_view(target.model, seq.tokens, drafter.config.target_layer_ids)
        for kind in kinds:
            stats = depth_stats(drafter, seq, view.logp, view.taps.to(drafter.fc.weight.dtype), kind, weaver=weaver,
                                temperature=temperature)
            acc = totals.setdefault(kind, {k: torch.zeros_like(v) for k, v in stats.items()})
            for k, v in stats.items():
                acc[k] += v
    report = {}
    for kind, t in totals.items():
        n = t["count"].clamp_min(1)
        report[kind] = {"depth": list(range(1, len(n) + 1)), "tvd": (t["tvd"] / n).tolist(),
                        **{f"top{k}_coverage": (t[f"top{k}"] / n).tolist() for k in COVERAGE_K},
                        "anchors": t["count"].long().tolist()}
    return report


def format_table(report: dict) -> str:
    kinds = list(report)
    head = "depth " + " ".join(f"{k + ' ' + m:>16}" for k in kinds for m in ("tvd", "top1", "top5"))
    lines = [head]
    for d in range(len(report[kinds[0]]["depth"])):
        cells = []
        for k in kinds:
            r = report[k]
            cells += [f"{r['tvd'][d]:>16.3f}", f"{r['top1_coverage'][d]:>16.3f}", f"{r['top5_coverage'][d]:>16.3f}"]
        lines.append(f"{d + 1:>5} " + " ".join(cells))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tvd, ax_cov) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (kind, r) in enumerate(report.items()):  # one colour per kind in both panels
        ax_tvd.plot(r["depth"], r["tvd"], marker="o", color=f"C{i}", label=kind)
        ax_cov.plot(r["depth"], r["top1_coverage"], marker="o", color=f"C{i}", label=f"{kind} top-1")
        ax_cov.plot(r["depth"], r["top5_coverage"], marker="x", linestyle="--", color=f"C{i}", label=f"{kind} top-5")
    ax_tvd.set(xlabel="depth", ylabel="TVD to the target", title="total-variation distance", ylim=(0, 1))
    ax_cov.set(xlabel="depth", ylabel="coverage", title="target token in drafter top-k", ylim=(0, 1))
    for ax in (ax_tvd, ax_cov):
        ax.set_xticks(next(iter(report.values()))["depth"])
    ax_tvd.legend()
    ax_cov.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
