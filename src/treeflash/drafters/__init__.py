"""Decoding methods, each a drafter behind one interface (see base.Drafter). The block methods are one class,
BlockDrafter: a backbone (DFlash or DFlash2) plus the method's tree builder (builders.py)."""

from __future__ import annotations

from .ar import AutoregressiveDrafter
from .base import Drafter
from .block import BlockDrafter, block_drafter
from .eagle3 import Eagle3Decoder
from .load import (load_block_drafter, load_dflash2_drafter, load_eagle3_drafter, load_rest_drafter,
                   load_weaver_drafter)
from .pld import PromptLookupDrafter

METHODS = ("ar", "pld", "rest", "dflash", "ddtree", "treeflash", "tfm", "dflash2", "dflash2-tree", "eagle3")


def make_drafter(name: str, target=None, drafter_path: str | None = None, weaver_path: str | None = None,
                 width: int = 8, draft_vocab_size: int | None = None, datastore_path: str | None = None) -> Drafter:
    """The drafter for method `name`. Block drafters read the verifying `target` and a trained drafter
    (`drafter_path`, default: the one shipped for the target), whose LM head scores `draft_vocab_size` tokens
    (None: as its config says; 0: all); `tfm` also a Weaver (`weaver_path`) and expands `width` nodes per call.
    `dflash2` and `dflash2-tree` need a DFlash2 folder (`drafter_path`; none ships); it scores the whole vocabulary.
    `rest` is prompt lookup with a datastore of the target's answers (`datastore_path`, default: the one shipped).
    `eagle3` needs an EAGLE-3 folder (`drafter_path`; none ships)."""
    if name == "ar":
        return AutoregressiveDrafter()
    if name == "pld":
        return PromptLookupDrafter()
    if name == "rest":
        return load_rest_drafter(target, datastore_path)
    if name in ("dflash", "ddtree", "treeflash"):
        return load_block_drafter(name, target, drafter_path, draft_vocab_size)
    if name == "tfm":
        return load_weaver_drafter(target, drafter_path, weaver_path, width, draft_vocab_size)
    if name in ("dflash2", "dflash2-tree"):
        return load_dflash2_drafter(target, drafter_path, name)
    if name == "eagle3":
        return load_eagle3_drafter(target, drafter_path)
    raise KeyError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


__all__ = ["METHODS", "AutoregressiveDrafter", "BlockDrafter", "Drafter", "Eagle3Decoder", "PromptLookupDrafter",
           "block_drafter", "make_drafter"]
