"""What a training run is asked to do, one typed config per kind: `treeflash train KIND` builds one from its
options (whose defaults are these), and library users build their own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..runtime.loading import DEFAULT_TARGET
from .losses import POSITION_DECAY
from .store import DEFAULT_STORE


@dataclass
class TrainRun:
    """Every kind's: data, target, schedule, checkpoints (the command line's help says what each one does)."""

    kind: ClassVar[str] = ""
    out: str = ""  # the run folder: checkpoint.pt, log.jsonl and the trained model
    data: str = DEFAULT_STORE  # answer stores written by `treeflash data regen`, comma-separated
    sources: str | None = None  # keep these sources' answers only, e.g. "sharegpt,gsm8k:300" (store.select_sources)
    repeat: str | None = None  # take these answers N times an epoch, e.g. "sharegpt@0=3" (store.repeat_answers)
    data_dir: str | None = None  # where the prompt sets are (../shared/data, or TREEFLASH_DATA)
    target: str = DEFAULT_TARGET
    target_dtype: str = "auto"
    device: str | None = None
    steps: int = 1000
    batch_size: int | None = None  # over all processes (None: trainer.batch_size_for)
    lr: float = 6e-4
    num_anchors: int = 512
    threads: int | None = None
    max_len: int = 512
    bf16: bool | None = None  # None: where the hardware multiplies bf16 natively
    save_every: int = 100
    log_every: int = 10
    keep_every: int = 0
    seed: int = 0
    no_resume: bool = False

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("a training run needs its folder (out)")


@dataclass
class FreshDrafterRun(TrainRun):
    """A fresh drafter's sizes (a trained one keeps its own)."""

    layers: int = 3
    taps: int = 5
    intermediate_size: int | None = None  # None: the target's
    block_size: int = 16
    mask_token: str | None = None  # an id or the token's text; None: the tokenizer's mask token, else a spare one


@dataclass
class DFlashRun(FreshDrafterRun):
    kind: ClassVar[str] = "dflash"
    init_layers: str = "random"
    init: str | None = None  # a trained DFlash drafter to go on training
    add_layers: int = 0  # with init: draft layers added on top, each starting as the identity
    kl_topk: int = 0
    loss_decay: float = POSITION_DECAY  # position k of a block weighs exp(-(k - 1) / loss_decay) in the loss
    draft_vocab: int | None = None
    grad_checkpoint: bool = False  # recompute the drafter's layers in the backward pass (less memory)
    short_blocks: float | None = None  # the share of blocks cut to random lengths (None: 0.5 if trained so, else 0)


@dataclass
class TreeFlashRun(TrainRun):
    kind: ClassVar[str] = "treeflash"
    backbone: str = ""  # a DFlash drafter (or a TreeFlash one: its AR layer trained further)
    freeze_backbone: bool = False
    ar_kind: str = "swiglu"
    prev_tokens: int = 1
    ar_intermediate_size: int | None = None
    init: str | None = None  # a TreeFlash drafter whose AR layer starts the training
    kl_topk: int = 0
    loss_decay: float = POSITION_DECAY  # as DFlashRun's
    draft_vocab: int | None = None
    grad_checkpoint: bool = False
    short_blocks: float | None = None  # as DFlashRun's


@dataclass
class WeaverRun(TrainRun):
    kind: ClassVar[str] = "weaver"
    backbone: str = ""  # the DFlash drafter, frozen
    width: int | None = None
    weaver_layers: int = 1
    heads: int | None = None
    top_k: int = 512
    init: str | None = None  # a trained Weaver to go on training
    short_blocks: float | None = None  # as DFlashRun's (the backbone must be trained for short blocks)


@dataclass
class DFlash2Run(FreshDrafterRun):
    kind: ClassVar[str] = "dflash2"
    backbone: str | None = None
    init: str | None = None
    selector_only: bool = False
    selector_rank: int = 32
    selector_top_k: int = 16
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_weight: float = 1.0
    grad_checkpoint: bool = False


@dataclass
class Eagle3Run(TrainRun):
    kind: ClassVar[str] = "eagle3"
    init: str | None = None  # a trained EAGLE-3 drafter to go on training
    draft_vocab: int | None = None  # None: 4,096 (as the DFlash drafters); 0: the whole vocabulary
    ttt_steps: int = 7  # training-time-test steps (EAGLE-3's 7)


RUNS = {c.kind: c for c in (DFlashRun, TreeFlashRun, WeaverRun, DFlash2Run, Eagle3Run)}
