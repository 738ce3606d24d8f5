"""Bad files a user will hit: each is a one-line error naming the file and what is wrong, never a traceback."""

import json

import pytest

from treeflash.cli import main

from conftest import tiny_target
from test_cli import tiny_folder  # noqa: F401  (fixture)
from test_dflash import tiny_drafter


def break_weights(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut short
    return "model.safetensors is not a readable safetensors file"


def break_json(folder):
    (folder / "config.json").write_text('{"hidden_size": 32,')
    return "config.json is not valid JSON"


def drop_field(folder):
    raw = json.loads((folder / "config.json").read_text())
    del raw["hidden_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    return "config.json: missing field ('hidden_size')"


def wrong_field(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw["num_hidden_layers"] = "three"
    (folder / "config.json").write_text(json.dumps(raw))
    return "config.json: wrong field"


def other_target(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 7]  # taps a layer the 2-layer target lacks
    (folder / "config.json").write_text(json.dumps(raw))
    return "does not fit the target"


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("breakage", [break_weights, break_json, drop_field, wrong_field, other_target])
def test_a_broken_drafter_is_one_line(tmp_path, tiny_folder, capsys, kind, breakage):  # noqa: F811
    from treeflash.models.dflash2 import DFlash2Drafter
    from treeflash.target import Target

    target = Target.load(tiny_folder, dtype="float32")
    folder = tmp_path / "drafter"
    drafter = tiny_drafter(target)
    if kind == "dflash2":
        drafter = DFlash2Drafter.from_dflash(drafter, conv_kernel_size=2, conv_group_size=16, selector_rank=4,
                                             selector_top_k=4)
    drafter.save_pretrained(folder)
    expected = breakage(folder)
    method = "ddtree" if kind == "dflash" else "dflash2"
    capsys.readouterr()
    code = main(["generate", "hi", "--target", tiny_folder, "--drafter", str(folder), "--method", method,
                 "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err and "Traceback" not in err, err


def test_a_broken_weaver_is_one_line(tmp_path, capsys):
    from treeflash.models.checkpoint import DrafterError
    from treeflash.models.weaver import Weaver, WeaverConfig

    drafter = tiny_drafter(tiny_target("llama"))
    weaver = Weaver(WeaverConfig.for_drafter(drafter.config, None, 1, None, 8))
    for breakage in (break_weights, break_json, wrong_field):
        folder = tmp_path / breakage.__name__
        weaver.save_pretrained(folder)
        expected = breakage(folder)
        with pytest.raises(DrafterError, match="config.json|safetensors") as info:
            Weaver.from_pretrained(folder)
        assert expected.split(":")[0].split(" ")[0] in str(info.value) and "\n" not in str(info.value)
