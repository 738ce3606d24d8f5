"""DFlash block drafting: one drafter forward per round, then a chain (`dflash`) or a DDTree (`ddtree`).

The drafter keeps the injected context K/V of every committed position across rounds and appends only the
positions accepted since the previous round.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.dflash import DFlashDrafter
from ..tree import DraftTree
from ..trees import best_first_tree, chain_tree

# drafters that ship with treeflash, by target name
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
SHIPPED = {"smollm2-135m-instruct": CHECKPOINTS / "smollm2-135m-instruct-dflash"}
BUILDERS = {"dflash": chain_tree, "ddtree": best_first_tree}


def default_drafter_path(target_name: str) -> Path:
    if target_name not in SHIPPED or not (SHIPPED[target_name] / "config.json").exists():
        raise FileNotFoundError(f"no shipped DFlash drafter for target {target_name!r}: pass --drafter PATH "
                                f"(a folder written by `treeflash train dflash` or a published DFlash checkpoint)")
    return SHIPPED[target_name]


class BlockDrafter:
    def __init__(self, model: DFlashDrafter, method: str = "ddtree"):
        self.model, self.name, self.build = model.eval(), method, BUILDERS[method]
        self.taps = tuple(model.config.target_layer_ids)
        self.reset()

    def reset(self) -> None:
        self.ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.ctx_len = 0

    @torch.no_grad()
    def observe(self, features: torch.Tensor) -> None:
        """Append the injected K/V of newly committed positions (features [m, n_taps, H])."""
        positions = torch.arange(self.ctx_len, self.ctx_len + len(features), device=features.device)
        new = self.model.context_kv(self.model.fuse(features), positions)
        self.ctx_kv = new if self.ctx_kv is None else [
            (torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(self.ctx_kv, new)]
        self.ctx_len += len(features)

    def propose(self, tokens, features, budget) -> DraftTree:
        if features is not None and len(features):
            self.observe(features)
        assert self.ctx_len == len(tokens) - 1, "the drafter's context must cover every committed position"
        logits = self.model.draft_logits(tokens[-1], self.ctx_len, self.ctx_kv)
        return self.build(tokens[-1], logits, budget)


def load_block_drafter(method: str, target, path: str | Path | None = None) -> BlockDrafter:
    model = DFlashDrafter.from_pretrained(path or default_drafter_path(target.name), dtype=target.model.dtype)
    return BlockDrafter(model.attach(target.model).to(target.device), method)
