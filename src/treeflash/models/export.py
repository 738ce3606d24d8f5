"""`treeflash export DRAFTER --to DIR`: a drafter trained here, as a self-contained folder other engines load.

DIR holds the DFlash drafter in the published DFlash format (what SGLang's and vLLM's `dflash` method, llama.cpp's
DFlash support and the reference `dflash` package read), a README with the command lines that serve it, and, for a
TreeFlash drafter, `treeflash/` in the published TreeFlash layout. The target's embedding and LM head are never
copied: every engine uses the target's own.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import __version__
from ..runtime import hub_id
from .checkpoint import DrafterError
from .dflash import DFlashDrafter
from .dflash2 import DFlash2Drafter, is_dflash2
from .eagle3 import Eagle3Drafter, is_eagle3

TREEFLASH_DIR = "treeflash"


def export_drafter(source: str | Path, out: str | Path, target: str) -> dict:
    """Write `source` (a DFlash, TreeFlash, DFlash2 or EAGLE-3 drafter folder, adapters included) to `out`; returns
    a summary."""
    if is_dflash2(source):
        return _export_dflash2(source, out, target)
    if is_eagle3(source):
        return _export_eagle3(source, out, target)
    drafter = DFlashDrafter.from_pretrained(source)
    c = drafter.config
    if c.mask_token_id is None:
        raise DrafterError(f"{source} has a learned mask embedding, which the published format cannot hold: train "
                           "it again with `treeflash train dflash` (it picks a mask token id)")
    out = Path(out)
    drafter.save_dflash(out)
    treeflash = None
    if drafter.ar_layer is not None and c.published_treeflash:
        drafter.save_pretrained(out / TREEFLASH_DIR)
        treeflash = f"{TREEFLASH_DIR}/"
    elif drafter.ar_layer is not None:
        treeflash = f"not written: the published TreeFlash layout cannot express its AR layer {c.ar_layer}"
    summary = {"source": str(source), "out": str(out), "target": hub_id(target), "block_size": c.block_size,
               "mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids, "treeflash": treeflash,
               "gguf": "not written: llama.cpp's GGUF tools (gguf 0.19) define no DFlash architecture yet"}
    (out / "README.md").write_text(_readme(summary))
    return summary


def _export_dflash2(source: str | Path, out: str | Path, target: str) -> dict:
    """A DFlash2 drafter, in the published DFlash2 layout (what the reference `DFlash2DraftModel` reads)."""
    drafter = DFlash2Drafter.from_pretrained(source)
    drafter.save_pretrained(out)
    c = drafter.dflash2
    summary = {"source": str(source), "out": str(out), "target": hub_id(target), "architecture": "DFlash2DraftModel",
               "block_size": c.backbone.block_size, "mask_token_id": c.backbone.mask_token_id,
               "target_layer_ids": c.backbone.target_layer_ids}
    (Path(out) / "README.md").write_text(f"""# A DFlash2 drafter for {summary['target']}

Exported by `treeflash export` (treeflash {__version__}) from `{source}`, in the published DFlash2 layout:
DFlash's draft layers with a grouped dynamic causal conv around each sub-layer and a candidate selector;
`dflash_config` = block size {c.backbone.block_size}, mask token id {c.backbone.mask_token_id}, target layers
{c.backbone.target_layer_ids}, conv kernel {c.conv_kernel_size} (groups of {c.conv_group_size}), selector rank
{c.selector_rank}, top {c.selector_top_k} candidates. The target's embedding and LM head are not included.

- The reference implementation (`pip install dflash`): `DFlash2DraftModel.from_pretrained("{Path(out).resolve()}")`.
- treeflash: `treeflash generate "Hello" --target {summary['target']} --drafter {Path(out).resolve()} --method dflash2`.
""")
    return summary


def _export_eagle3(source: str | Path, out: str | Path, target: str) -> dict:
    """An EAGLE-3 drafter, in SpecForge's `LlamaForCausalLMEagle3` layout (ours already), with the serving commands
    of SGLang and vLLM (their EAGLE-3 methods; not run here)."""
    drafter = Eagle3Drafter.from_pretrained(source)
    drafter.save_pretrained(out)
    c, out = drafter.config, Path(out).resolve()
    summary = {"source": str(source), "out": str(out), "target": hub_id(target),
               "architecture": "LlamaForCausalLMEagle3", "draft_vocab_size": c.draft_vocab_size,
               "target_layer_ids": c.target_layer_ids}
    vllm = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    taps = c.target_layer_ids or "1, L / 2 - 1 and L - 4 (the engines' default: the config names none)"
    (out / "README.md").write_text(f"""# An EAGLE-3 drafter for {summary['target']}

Exported by `treeflash export` (treeflash {__version__}) from `{source}`, in SpecForge's `LlamaForCausalLMEagle3`
layout: `fc` over the outputs of target layers {taps} (`eagle_config.eagle_aux_hidden_state_layer_ids`),
one decoder layer (`midlayer`), `norm`, `lm_head` over {c.draft_vocab_size} draft tokens with `d2t` / `t2d`. The
target's token embedding is not included: the engines share the target's.

## Serve it (these command lines were not run here)

SGLang:

```bash
python -m sglang.launch_server --model-path {summary['target']} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 4 \\
    --speculative-num-draft-tokens 8
```

vLLM:

```bash
vllm serve {summary['target']} --speculative-config '{vllm}'
```

treeflash: `treeflash generate "Hello" --target {summary['target']} --drafter {out} --method eagle3`.
""")
    return summary


def _readme(s: dict) -> str:
    out, target, g = Path(s["out"]).resolve(), s["target"], s["block_size"]
    treeflash = (f"- `{s['treeflash']}`: the TreeFlash drafter in the layout of the public TreeFlash code "
                 f"(ETH-DISCO/TreeFlash: `TreeFlashDraftModel.from_pretrained`)." if s["treeflash"] == "treeflash/"
                 else f"- TreeFlash: {s['treeflash']}." if s["treeflash"] else "")
    return f"""# A DFlash drafter for {target}

Exported by `treeflash export` (treeflash {__version__}) from `{s['source']}`, in the published DFlash format:
Qwen3-style draft layers, `dflash_config` = block size {g}, mask token id {s['mask_token_id']} (a token of the
target's vocabulary, embedded by the target's own row), target layers {s['target_layer_ids']}. The target's
embedding and LM head are not included: every engine uses the target's own.

{treeflash}
- GGUF: {s['gguf']}.

## Serve it

SGLang:

```bash
python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH \\
    --speculative-draft-model-path {out} --speculative-num-draft-tokens {g}
```

vLLM:

```bash
vllm serve {target} --speculative-config '{json.dumps({"method": "dflash", "model": str(out),
                                                       "num_speculative_tokens": g - 1})}'
```

treeflash (chain, tree, or the OpenAI-compatible server):

```bash
treeflash generate "Hello" --target {target} --drafter {out} --method ddtree
treeflash serve --target {target} --drafter {out} --method ddtree
```

The reference implementation (`pip install dflash`): `DFlashDraftModel.from_pretrained("{out}")`.
"""
