"""Loading a method's drafter: the models shipped for a target, or the user's folders, in the drafting dtype."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..models.checkpoint import DrafterError, error_line

from ..models.dflash import DFlashDrafter

from ..models.dflash_io import draft_vocab
from ..models.dflash2 import DFlash2Drafter, is_dflash2
from ..models.eagle3 import Eagle3Drafter, is_eagle3
from ..runtime import int4
from ..runtime.packed import pack_linears
from ..models.weaver import Weaver
from .block import BlockDrafter, block_drafter, drafting_dtype
from .datastore import FILE as DATASTORE_FILE, Datastore
from .eagle3 import Eagle3Decoder
from .pld import PromptLookupDrafter

log = logging.getLogger(__name__)

# drafters that ship with treeflash, by target name and kind
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
SHIPPED = {("smollm2-135m-instruct", "dflash"): CHECKPOINTS / "smollm2-135m-instruct-dflash",
           ("smollm2-135m-instruct", "treeflash"): CHECKPOINTS / "smollm2-135m-instruct-treeflash",
           ("smollm2-135m-instruct", "weaver"): CHECKPOINTS / "smollm2-135m-instruct-weaver"}
# retrieval drafting's datastores (method rest), by target name: the target's greedy answers to the training prompts
DATASTORES = {"smollm2-135m-instruct": CHECKPOINTS / "smollm2-135m-instruct-datastore"}


def shipped_drafter(target_name: str, kind: str) -> Path | None:
    """The folder of the `kind` ("dflash", "treeflash" or "weaver") model shipped for a target, if there is one.
    The shipped TreeFlash AR layer and Weaver were trained on the shipped DFlash drafter, frozen."""
    path = SHIPPED.get((target_name, kind))
    return path if path is not None and (path / "config.json").exists() else None


def default_drafter_path(target_name: str, kind: str) -> Path:
    path = shipped_drafter(target_name, kind)
    if path is None:
        raise FileNotFoundError(f"no shipped {kind} drafter for target {target_name!r}: pass --drafter PATH "
                                f"(a folder written by `treeflash train {kind}`)")
    return path


def default_weaver_path(target_name: str, drafter_path: str | Path | None) -> Path | None:
    """The Weaver shipped for the target, which fits only the shipped drafter: None when another is named."""
    return shipped_drafter(target_name, "weaver") if drafter_path is None else None


def shipped_datastore(target_name: str) -> Path | None:
    """The datastore shipped for a target (method rest), if there is one."""
    path = DATASTORES.get(target_name)
    return path if path is not None and (path / DATASTORE_FILE).exists() else None


def load_rest_drafter(target, path: str | Path | None = None) -> PromptLookupDrafter:
    """Prompt lookup with a datastore: the one named, else the one shipped for the target."""
    path = path or shipped_datastore(target.name)
    if path is None:
        raise FileNotFoundError(f"no datastore ships for target {target.name!r}: build one from its answers with "
                                "`treeflash data datastore --out FOLDER` and pass --datastore FOLDER")
    datastore = Datastore.load(path)
    if datastore.vocab_size != target.config.vocab_size:
        raise DrafterError(f"the datastore at {path} holds token ids of a {datastore.vocab_size}-token vocabulary, "
                           f"the target has {target.config.vocab_size}: build it from this target's answers")
    return PromptLookupDrafter(datastore=datastore)


def load_drafter_model(target, path: str | Path, draft_vocab_size: int | None = None,
                       int4_products: bool | None = None) -> DFlashDrafter:
    """A drafter checkpoint attached to `target`, in the drafting dtype, scoring its draft vocabulary
    (`draft_vocab_size`: None: the config's, 0: every token), its products on packed weights (inference only).

    With `int4_products` (None: where the target's linears are 4-bit, `Target.int4_products`, the CPU's fast path)
    its linears and the LM-head rows it scores are rounded to 4 bits and multiplied on the target's kernel: after a
    target step, its round's products then cost half of what bf16 ones do (docs/results/int4-drafter). The drafts
    change a little (the τ that costs is measured there), the decoded tokens never: the target verifies them. The
    exact path (a dense target) keeps the drafter as trained."""
    model = DFlashDrafter.from_pretrained(path, dtype=drafting_dtype(target.device))
    model = model.attach(target.model).to(target.device)
    model.head_int4 = rounded_like_target(target, model, int4_products)
    return compiled_like(target, pack_linears(model.use_draft_vocab(draft_vocab(model, path, draft_vocab_size))))


def rounded_like_target(target, model: torch.nn.Module, int4_products: bool | None = None) -> bool:
    """Round the drafter's linears to 4 bits (keeping dense copies for many-row products) where `int4_products`
    says, None: where the target's are (`Target.int4_products`). Returns whether it did."""
    four_bit = target.int4_products if int4_products is None else int4_products
    if four_bit:
        int4.quantise_linears(model, torch.bfloat16, keep_weight=True)
    return four_bit


def compiled_like(target, model: DFlashDrafter) -> DFlashDrafter:
    """The drafter's block forward compiled where the target's layers are (`--compile`): a round then costs its
    products and little else. A drafter without a compiled form, or a toolchain that fails, drafts eager."""
    if target.compiled and target.device.type == "cpu":  # (a GPU target's CUDA graphs: the drafter stays eager)
        try:
            model.compile_block()
        except ValueError:
            pass
        except Exception as err:  # noqa: BLE001 (inductor's errors have no common type): drafting stays eager
            log.warning("compile: the drafter's block forward did not compile, drafting eager: %s", error_line(err))
    return model


def load_block_drafter(method: str, target, path: str | Path | None = None,
                       draft_vocab_size: int | None = None) -> BlockDrafter:
    """dflash, ddtree or treeflash: the shipped drafter of that kind for the target unless `path` names one."""
    kind = "treeflash" if method == "treeflash" else "dflash"
    model = load_drafter_model(target, path or default_drafter_path(target.name, kind), draft_vocab_size)
    return block_drafter(model, method)


def load_weaver_drafter(target, drafter_path: str | Path | None, weaver_path: str | Path | None,
                        width: int = 8, draft_vocab_size: int | None = None) -> BlockDrafter:
    weaver_path = weaver_path or default_weaver_path(target.name, drafter_path)
    if weaver_path is None:
        raise FileNotFoundError("method tfm needs a Weaver: pass --weaver PATH (a folder written by "
                                "`treeflash train weaver` on this drafter)")
    drafter_path = drafter_path or default_drafter_path(target.name, "dflash")
    model = load_drafter_model(target, drafter_path, draft_vocab_size)
    weaver = Weaver.from_pretrained(weaver_path, drafting_dtype(target.device),
                                    backbone=model.dflash_folder(drafter_path)).to(target.device)
    return block_drafter(model, "tfm", weaver=pack_linears(weaver), width=width)


def load_dflash2_drafter(target, path: str | Path | None, method: str = "dflash2") -> BlockDrafter:
    if path is None:
        raise FileNotFoundError("no DFlash2 drafter ships with treeflash: pass --drafter PATH (a folder in the "
                                "published DFlash2 format)")
    if not is_dflash2(path):
        raise DrafterError(f"{path} is not a DFlash2 drafter (config.json's architectures lack DFlash2DraftModel)")
    model = DFlash2Drafter.from_pretrained(path, dtype=drafting_dtype(target.device))
    return block_drafter(pack_linears(model.attach(target.model).to(target.device)), method)


def load_eagle3_drafter(target, path: str | Path | None, int4_products: bool | None = None) -> Eagle3Decoder:
    """Method eagle3 over the EAGLE-3 drafter in `path` (ours, or SpecForge's layout; none ships); its linears
    (LM head included) 4-bit where the target's are, as `load_drafter_model` does for a DFlash drafter."""
    if path is None:
        raise FileNotFoundError("no EAGLE-3 drafter ships with treeflash: pass --drafter PATH (one trained by "
                                "`treeflash train eagle3`, or a SpecForge / SGLang EAGLE-3 folder)")
    if not is_eagle3(path):
        raise DrafterError(f"{path} is not an EAGLE-3 drafter "
                           "(config.json's architectures lack LlamaForCausalLMEagle3)")
    model = Eagle3Drafter.from_pretrained(path, dtype=drafting_dtype(target.device))
    model = model.attach(target.model).to(target.device)
    rounded_like_target(target, model, int4_products)
    return Eagle3Decoder(pack_linears(model))
