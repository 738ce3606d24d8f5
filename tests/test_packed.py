"""Products on oneDNN-packed weights against F.linear, the plain reference they replace."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treeflash.runtime.packed import PackedLinear, pack, pack_linears

# bf16 packed products are bitwise F.linear's here; fp32 ones sum in another order
ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.0}
DTYPES = [torch.float32] + ([torch.bfloat16] if pack(torch.zeros(2, 2, dtype=torch.bfloat16)) is not None else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 17, 64])
def test_packed_linear_equals_f_linear(dtype, rows):
    torch.manual_seed(0)
    module = nn.Linear(96, 160, bias=True).to(dtype)
    packed = PackedLinear(module)
    assert packed.packed is not None
    x = torch.randn(2, rows, 96, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, module.weight, module.bias), atol=ATOL[dtype], rtol=0)


def test_pack_linears_keeps_the_state_dict_and_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.SiLU(), nn.Sequential(nn.Linear(16, 4)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linears(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    model(torch.randn(3, 8)).sum().backward()  # with autograd on, the plain weights: gradients flow
    assert model[0].weight.grad is not None and model[2][0].bias.grad is not None


def test_nothing_packs_off_the_cpu_or_in_half():
    assert pack(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert pack(torch.zeros(4, 4, device="meta")) is None


def test_a_loaded_drafter_drafts_as_its_plain_model(tmp_path):
    """Drafters load packed (`load_drafter_model`); the drafted scores equal the plain model's."""
    from conftest import tiny_target
    from test_dflash import tiny_drafter

    from treeflash.drafters.load import load_drafter_model
    from treeflash.models.dflash import DFlashDrafter

    target = tiny_target("llama")
    tiny_drafter(target, seed=1).save_pretrained(tmp_path / "d", dtype=torch.float32)
    loaded = load_drafter_model(target, tmp_path / "d", draft_vocab_size=0)
    dtype = loaded.fc.weight.dtype
    plain = DFlashDrafter.from_pretrained(tmp_path / "d", dtype=dtype).attach(target.model)
    assert isinstance(loaded.fc, PackedLinear) and isinstance(loaded.layers[0].mlp.down_proj, PackedLinear)
    assert not isinstance(plain.fc, PackedLinear)
    taps = torch.randn(10, 2, 64)
    with torch.no_grad():
        a, b = (m.scores(m(torch.tensor([3, 4]), torch.arange(10, 26), taps, None)) for m in (loaded, plain))
    torch.testing.assert_close(a.float(), b.float(), atol=ATOL[dtype] + 1e-5, rtol=0)
