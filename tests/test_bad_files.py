"""Bad files a user will hit: each is a one-line error naming the file and what is wrong, never a traceback; and
what an interrupted save leaves behind is never read as a checkpoint."""

import io
import json
from pathlib import Path

import pytest
import torch

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
    from treeflash.runtime import Target

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


# ---- a GGUF that is not one ------------------------------------------------------------------------------------
def gguf_bytes(cut: float) -> bytes:
    """The first `cut` of the embedded target's GGUF: what a download stopped early leaves."""
    from treeflash.runtime import embedded_gguf

    data = embedded_gguf("smollm2-135m-instruct").read_bytes()
    return data[: int(len(data) * cut)]


NOT_GGUF = {  # name: (the file's bytes, what the error says)
    "text": (lambda: b"model: smollm2\n", "is not a GGUF file"),
    "empty": (lambda: b"", "is not a GGUF file"),
    "header only": (lambda: b"GGUF\x03\x00\x00\x00", "is not a readable GGUF file (truncated or corrupted?"),
    "metadata cut": (lambda: gguf_bytes(0.01), "is not a readable GGUF file (truncated or corrupted?"),
    "tensors cut": (lambda: gguf_bytes(0.2), "is not a readable GGUF file (truncated or corrupted?"),
}


@pytest.mark.parametrize("name", NOT_GGUF)
def test_a_gguf_that_is_not_one_is_one_line(tmp_path, monkeypatch, capsys, name):
    make, expected = NOT_GGUF[name]
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))  # nothing lands in the user's cache
    path = tmp_path / "model.gguf"
    path.write_bytes(make())
    capsys.readouterr()
    code = main(["generate", "hi", "--target", str(path), "--method", "ar", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    # the only other line a GGUF target may print is the warning that it is being dequantised
    errors = [line for line in err.splitlines() if "dequantising" not in line]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"treeflash: error: {path} {expected}"), err
    assert "Traceback" not in err
    assert not list((tmp_path / "cache").glob("targets/*")), "a half-written dequantised copy was left behind"


# ---- leftover temporary files ------------------------------------------------------------------------------------
def test_a_save_cut_short_resumes_from_the_last_whole_checkpoint(tmp_path, tiny_folder, monkeypatch):  # noqa: F811
    """Interrupted while writing checkpoint.pt, a run leaves the previous checkpoint and a partial temporary file;
    the resumed run ignores that file and ends with the weights of a run that was never stopped."""
    from test_train import train_args, write_store

    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "straight", 4)) == 0
    real_save, saves = torch.save, []

    def save_cut_short(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) < 2:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()  # the second save (step 4): half its bytes reach the disk, then the run is stopped
        real_save(obj, buffer)
        Path(f).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise KeyboardInterrupt

    run = tmp_path / "cut"
    monkeypatch.setattr(torch, "save", save_cut_short)
    assert main(train_args(tmp_path, tiny_folder, run, 4)) == 130
    monkeypatch.undo()
    assert (run / ".checkpoint.pt.tmp").is_file()  # the leftover
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 2
    assert main(train_args(tmp_path, tiny_folder, run, 4)) == 0
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(run / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=0, rtol=0)


def truncate_checkpoint(path: Path) -> str:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "is not a readable training checkpoint (truncated or corrupted?"


def foreign_checkpoint(path: Path) -> str:
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)  # another tool's checkpoint.pt
    return "is not a treeflash training checkpoint"


@pytest.mark.parametrize("breakage", [truncate_checkpoint, foreign_checkpoint])
def test_a_broken_training_checkpoint_is_one_line(tmp_path, tiny_folder, capsys, breakage):  # noqa: F811
    from test_train import train_args, write_store

    write_store(tmp_path, tiny_folder)
    run = tmp_path / "run"
    assert main(train_args(tmp_path, tiny_folder, run, 2)) == 0
    expected = breakage(run / "checkpoint.pt")
    capsys.readouterr()
    assert main(train_args(tmp_path, tiny_folder, run, 4)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"treeflash: error: {run / 'checkpoint.pt'} {expected}") and "\n" not in err, err


def test_an_answer_store_ignores_what_an_interrupted_write_left(tmp_path, tiny_folder):  # noqa: F811
    """A regen stopped mid-shard leaves a temporary file; one stopped between the rename and the manifest line
    leaves a shard the manifest does not name. Neither is read, `data check` names the stray shard, and the next
    write replaces both."""
    from test_train import STORE_META, write_store
    from treeflash.runtime import Target
    from treeflash.train.store import AnswerStore, load_answers

    folder = write_store(tmp_path, tiny_folder)
    store = AnswerStore(folder)
    encode = Target.load(tiny_folder, dtype="float32").encode_prompt
    before = load_answers(folder, encode, tmp_path / "data")
    (folder / ".shard-00001.npz.tmp").write_bytes(b"PK\x03\x04 half a shard")
    (folder / "shard-00001.npz").write_bytes((folder / "shard-00000.npz").read_bytes())  # renamed, never listed
    assert load_answers(folder, encode, tmp_path / "data") == before
    assert store.verify() == ["shard-00001.npz: not in the manifest"]
    store.append(["gsm8k/0"], [encode("What is 0 times 0?")], [[5, 6, 7]], {**STORE_META, "temperature": 1.0})
    assert store.verify() == [] and len(load_answers(folder, encode, tmp_path / "data")) == len(before) + 1
