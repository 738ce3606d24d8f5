"""Decoding methods, each a drafter behind one interface (see base.Drafter)."""

from __future__ import annotations

from .ar import AutoregressiveDrafter
from .base import Drafter
from .dflash import BlockDrafter, load_block_drafter
from .pld import PromptLookupDrafter

METHODS = ("ar", "pld", "dflash", "ddtree", "treeflash")


def make_drafter(name: str, target=None, drafter_path: str | None = None) -> Drafter:
    """The drafter for method `name`. Block drafters read the verifying `target` and a trained drafter
    (`drafter_path`, default: the one shipped for the target)."""
    if name == "ar":
        return AutoregressiveDrafter()
    if name == "pld":
        return PromptLookupDrafter()
    if name in ("dflash", "ddtree", "treeflash"):
        return load_block_drafter(name, target, drafter_path)
    raise KeyError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


__all__ = ["METHODS", "AutoregressiveDrafter", "BlockDrafter", "Drafter", "PromptLookupDrafter", "make_drafter"]
