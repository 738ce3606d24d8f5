"""`treeflash export`: the published formats, checked against the reference DFlash implementation (`pip install
dflash`, installed without dependencies by scripts/setup.sh; the test is skipped where it is missing)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from treeflash.cli import main
from treeflash.models.dflash import DFlashDrafter
from treeflash.models.dflash_config import DFlashConfig
from test_cli import tiny_folder  # noqa: F401  (fixture)

ATOL, RTOL = 1e-5, 1e-4  # fp32, two implementations of the same forward


def random_drafter(target_model, ar_layer: bool = False, mask_token_id=16) -> DFlashDrafter:
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target_model.config, num_layers=2, num_taps=2, block_size=4,
                                     mask_token_id=mask_token_id)
    drafter = DFlashDrafter(config)
    with torch.no_grad():  # norms away from 1, so that a norm applied to the wrong tensor shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    if ar_layer:
        drafter.add_ar_layer("swiglu", 1)
        torch.nn.init.normal_(drafter.ar_layer.d.weight, std=0.1)
    return drafter.attach(target_model)


def test_export_writes_the_published_formats(tmp_path, tiny_folder):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    drafter = random_drafter(model, ar_layer=True)
    drafter.save_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert main(["export", str(tmp_path / "ours"), "--to", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "treeflash_config" not in config
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": 16,
                                       "target_layer_ids": drafter.config.target_layer_ids}
    readme = (out / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in readme and '"method": "dflash"' in readme
    assert '"num_speculative_tokens": 3' in readme and "treeflash/" in readme
    dflash, treeflash = DFlashDrafter.from_pretrained(out), DFlashDrafter.from_pretrained(out / "treeflash")
    assert dflash.ar_layer is None and treeflash.config.ar_layer == drafter.config.ar_layer
    for k, v in drafter.state_dict().items():  # bf16 on disk, as shipped
        torch.testing.assert_close(treeflash.state_dict()[k], v.to(torch.bfloat16).float(), atol=0, rtol=0)
        if not k.startswith("ar_layer."):
            torch.testing.assert_close(dflash.state_dict()[k], treeflash.state_dict()[k], atol=0, rtol=0)


def test_export_refuses_a_learned_mask_embedding(tmp_path, tiny_folder, capsys):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    random_drafter(model, mask_token_id=None).save_pretrained(tmp_path / "old")
    with pytest.warns(FutureWarning):
        assert main(["export", str(tmp_path / "old"), "--to", str(tmp_path / "out")]) == 2
    assert "learned mask embedding" in capsys.readouterr().err


def test_the_reference_implementation_loads_an_export(tmp_path, tiny_folder):  # noqa: F811
    """The reference DFlashDraftModel reads the exported folder and drafts what treeflash drafts: the same final
    states for the same context features and block."""
    reference = pytest.importorskip("dflash.model", reason="the reference `dflash` package is not installed")
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    drafter = random_drafter(model)
    drafter.save_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert main(["export", str(tmp_path / "ours"), "--to", str(tmp_path / "out")]) == 0
    theirs = reference.DFlashDraftModel.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ours = DFlashDrafter.from_pretrained(tmp_path / "out").attach(model)  # the same bf16-rounded weights
    assert (theirs.mask_token_id, theirs.block_size, theirs.target_layer_ids) == \
        (16, 4, drafter.config.target_layer_ids)

    C, g = 9, 4
    taps = torch.randn(C, 2, model.config.hidden_size)  # the target's tapped states of the context
    root = 42
    with torch.no_grad():
        block = torch.tensor([[root] + [theirs.mask_token_id] * (g - 1)])
        expected = theirs(position_ids=torch.arange(C + g)[None], noise_embedding=model.get_input_embeddings()(block),
                          target_hidden=taps.flatten(-2)[None])[0]
        ctx_kv = ours.context_kv(ours.fuse(taps), torch.arange(C))
        states = ours.hidden(ours.block_inputs(torch.tensor([root])), torch.arange(C, C + g), ctx_kv, None)
        torch.testing.assert_close(ours.norm(states), expected, atol=ATOL, rtol=RTOL)


def test_the_shipped_drafters_export(tmp_path):
    """The shipped SmolLM2 drafters are in the published DFlash format, so they export; their TreeFlash AR layer,
    half the MLP's width to keep the shipped weights small, stays in treeflash's own layout (said in the README)."""
    from treeflash.drafters.load import shipped_drafter
    from treeflash.models.export import export_drafter

    dflash = export_drafter(shipped_drafter("smollm2-135m-instruct", "dflash"), tmp_path / "d", "smollm2-135m-instruct")
    assert dflash["mask_token_id"] == 16 and dflash["treeflash"] is None  # <empty_output>
    treeflash = export_drafter(shipped_drafter("smollm2-135m-instruct", "treeflash"), tmp_path / "t",
                               "smollm2-135m-instruct")
    assert treeflash["treeflash"].startswith("not written")
    for out in ("d", "t"):  # the same DFlash drafter either way
        assert (tmp_path / out / "model.safetensors").read_bytes() == (tmp_path / "d" / "model.safetensors").read_bytes()
