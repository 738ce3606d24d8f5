"""`treeflash train average`: the element-wise mean of one model's checkpoints, and refusals where they differ."""

import json

import pytest
import torch

from treeflash.cli import main
from treeflash.models.checkpoint import DrafterError, read_weights
from treeflash.models.dflash import DFlashDrafter
from treeflash.train.average import average_checkpoints

from conftest import tiny_target
from test_dflash import tiny_drafter


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def saved(target, folder, seed):
    tiny_drafter(target, seed=seed).save_pretrained(folder)
    (folder / "token_ranking.json").write_text(json.dumps({"ranking": [3, 1, 2]}))
    return folder


def test_average_is_the_mean_and_loads(target, tmp_path):
    a, b = saved(target, tmp_path / "a", 0), saved(target, tmp_path / "b", 1)
    (a / "README.md").write_text("a model card, as a shipped drafter has: not part of the model\n")
    main(["train", "average", str(a), str(b), "--out", str(tmp_path / "mean")])
    assert not (tmp_path / "mean" / "README.md").exists()
    wa, wb, mean = read_weights(a), read_weights(b), read_weights(tmp_path / "mean")
    assert mean.keys() == wa.keys()
    for key, value in mean.items():
        assert value.dtype == wa[key].dtype
        expected = ((wa[key].float() + wb[key].float()) / 2).to(value.dtype)
        assert torch.equal(value, expected), key
    assert (tmp_path / "mean" / "token_ranking.json").read_bytes() == (a / "token_ranking.json").read_bytes()
    DFlashDrafter.from_pretrained(tmp_path / "mean")  # a drafter like its parts


def test_weighted_average(target, tmp_path):
    a, b = saved(target, tmp_path / "a", 0), saved(target, tmp_path / "b", 1)
    main(["train", "average", str(a), str(b), "--out", str(tmp_path / "mean"), "--weights", "1,3"])
    wa, wb, mean = read_weights(a), read_weights(b), read_weights(tmp_path / "mean")
    for key, value in mean.items():
        expected = (0.25 * wa[key].float() + 0.75 * wb[key].float()).to(value.dtype)
        assert torch.equal(value, expected), key
    average_checkpoints([a, b], tmp_path / "b-only", weights=[0, 1])
    assert all(torch.equal(v, wb[k]) for k, v in read_weights(tmp_path / "b-only").items())
    for bad in ([1], [1, -1], [0, 0]):
        with pytest.raises(DrafterError, match="one weight"):
            average_checkpoints([a, b], tmp_path / "out", weights=bad)


def test_average_of_one_model_only(target, tmp_path):
    a, b = saved(target, tmp_path / "a", 0), saved(target, tmp_path / "b", 1)
    with pytest.raises(DrafterError, match="two checkpoints"):
        average_checkpoints([a], tmp_path / "out")
    with pytest.raises(DrafterError, match="one of the checkpoints"):
        average_checkpoints([a, b], a)
    (b / "token_ranking.json").write_text(json.dumps({"ranking": [1, 2, 3]}))  # other FR-Spec rows
    with pytest.raises(DrafterError, match="token_ranking.json differs"):
        average_checkpoints([a, b], tmp_path / "out")
    other = tiny_drafter(target, seed=1, block_size=4)  # another shape of model
    other.save_pretrained(tmp_path / "c")
    (tmp_path / "c" / "token_ranking.json").write_bytes((a / "token_ranking.json").read_bytes())
    with pytest.raises(DrafterError, match="differs"):
        average_checkpoints([a, tmp_path / "c"], tmp_path / "out")
