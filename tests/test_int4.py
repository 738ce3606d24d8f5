"""4-bit weights: GGUF blocks decode to what gguf-py dequantises, the int4 kernel multiplies by the dequantised
weight, and every method stays exact on a target whose linears run on it."""

import random
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from treeflash import DraftTree, Target, generate
from treeflash.drafters import make_drafter
from treeflash.runtime.gguf_int4 import GGUFWeights, int4_linear, int4_parts, read_cache, write_cache
from treeflash.runtime.int4 import Int4Linear, Int4Weight, dequantise, quantise, quantise_model
from treeflash.tree import random_tree

from conftest import OracleTreeDrafter, TINY
from test_lossless import repetitive_prompt
from test_target import check_tree_logits

FP32_ATOL = 1e-5  # fp32 products in another summation order
FP32_RTOL = 1.3e-6  # torch.testing's own for fp32: sums of larger terms
FP32_ULPS = 4 * float(np.finfo(np.float32).eps)
# the dequantised fp32 target against the GGUF's own blocks with bf16 activations: bf16 rounds the activations
# and the kernel's scales to 8 significant bits, over 30 layers (measured: max 0.93 on logits of magnitude 39)
BF16_LOGIT_ATOL = 2.0
# a 4-bit weight of magnitude <= 0.1 with its scale and zero rounded to bf16 (8 significant bits), and a dense copy
# rounded to bf16 too: each off by at most 8 * 2^-9 of the group's range
BF16_SCALE_ATOL = 1e-3
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34, Q.Q4_K: 144}


def random_blocks(kind: Q, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `kind`'s block layout, with finite fp16 scales (the leading two fields)."""
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[kind]
    data = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
    for at in (0, 2) if kind in (Q.Q4_1, Q.Q4_K) else (0,):
        data[:, at:at + 2] = (0.01 * rng.standard_normal((len(data), 1))).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(BLOCK_BYTES), ids=lambda k: k.name)
def test_gguf_blocks_decode_to_what_gguf_py_dequantises(kind):
    data = random_blocks(kind, rows=32, blocks_per_row=2 if kind == Q.Q4_K else 8)
    parts = int4_parts(data, kind)
    weight = sum(dequantise(*(torch.from_numpy(a) for a in part)) for part in parts)
    assert all(q.max() <= 15 for q, _, _ in parts)
    # (q - 8) * scale + zero rounds otherwise than d * q - m: a few fp32 ulps of the largest weight apart
    reference = dequantize(data, kind)
    np.testing.assert_allclose(weight.numpy(), reference, rtol=0, atol=FP32_ULPS * np.abs(reference).max())


def test_formats_that_do_not_map_exactly_are_refused():
    data = quantize(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32), Q.Q5_0)
    with pytest.raises(KeyError):
        int4_parts(data, Q.Q5_0)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_int4_linear_of_gguf_blocks_multiplies_by_the_dequantised_weight(kind):
    dense = np.random.default_rng(1).standard_normal((48, 96)).astype(np.float32)
    data = quantize(dense, kind)  # gguf-py's own quantiser
    x = torch.randn(5, 96)
    linear = int4_linear(data, kind, torch.float32)
    torch.testing.assert_close(linear(x), x @ torch.from_numpy(dequantize(data, kind)).T, atol=FP32_ATOL,
                               rtol=FP32_RTOL)
    torch.testing.assert_close(linear.dense_weight(), torch.from_numpy(dequantize(data, kind)), atol=1e-6, rtol=0)


def random_int4(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[Int4Weight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = 0.01 + 0.01 * torch.rand(n, k // 32, generator=g)
    zero = 0.01 * torch.randn(n, k // 32, generator=g)
    return Int4Weight.from_ints(q, scale, zero, dtype), dequantise(q, scale, zero)


def test_the_kernel_computes_every_row_on_its_own():
    """The engine relies on it: a verified tree's products equal single-token steps', bit for bit, in bf16 too."""
    for dtype in (torch.float32, torch.bfloat16):
        w, _ = random_int4(64, 96, dtype)
        x = torch.randn(17, 96).to(dtype)
        rows = torch.cat([w.matmul(x[i:i + 1]) for i in range(17)])
        assert torch.equal(w.matmul(x), rows)


def test_a_strided_input_multiplies_as_its_contiguous_copy():
    """HF's generate takes the logits of a batch's last positions, a strided view, in bf16 (no cast copies it)."""
    linear = Int4Linear([random_int4(64, 96, torch.bfloat16)[0]])
    hidden = torch.randn(3, 5, 96).bfloat16()
    last = hidden[:, -1:, :]
    assert not last.reshape(-1, 96).is_contiguous()
    assert torch.equal(linear(last), linear(last.contiguous()))


def test_fp32_activations_around_bf16_products_round_only_the_products_inputs():
    """Under dtype auto without native bf16, the activations stay fp32 and a bf16 kernel multiplies: the product
    of x rounded to bf16, then widened; Q8_0's two halves are summed in fp32."""
    parts = [random_int4(64, 96, torch.bfloat16, seed=s)[0] for s in (1, 2)]
    linear = Int4Linear(parts)
    assert linear.kernel_dtype == torch.bfloat16
    x = torch.randn(5, 96)
    expected = sum(p.matmul(x.bfloat16()).float() for p in parts)
    y = linear(x)
    assert y.dtype == torch.float32 and torch.equal(y, expected)


def test_fused_linears_equal_the_separate_ones_and_share_their_values():
    parts = [Int4Linear([random_int4(n, 64, torch.float32, seed=n)[0]], bias=torch.randn(n)) for n in (128, 64, 48)]
    x = torch.randn(3, 64)
    separate = torch.cat([m(x) for m in parts], dim=-1)
    fused = Int4Linear.fuse(parts)
    torch.testing.assert_close(fused(x), separate, atol=FP32_ATOL, rtol=0)  # N's blocking may sum otherwise
    assert torch.equal(torch.cat([m(x) for m in parts], dim=-1), separate)  # re-pointed to its rows
    assert parts[1].parts[0].packed.data_ptr() == fused.parts[0].packed[128:].data_ptr()
    # rows that are not whole packed blocks (a tiny model's 32-row k and v) do not fuse: they run one by one
    assert Int4Linear.fuse([Int4Linear([random_int4(n, 64, torch.float32)[0]]) for n in (32, 32)]) is None


def test_quantise_rounds_within_half_a_step():
    w = torch.randn(32, 64)
    q, scale, zero = quantise(w)
    err = (dequantise(q, scale, zero) - w).abs()
    assert (err <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()


WIDE = dict(hidden_size=128, intermediate_size=256)  # k and v of 64 rows: whole packed blocks, so q|k|v fuse


def int4_tiny(kind: str = "llama", runtime: str = "auto", head_parts: int = 0, **overrides) -> Target:
    """A tiny random target whose linears (LM head aside) run on the int4 kernel, fp32 activations. With
    `head_parts` 1 or 2 the LM head too: its weight rounded to 4 bits, and with 2 its rounding error rounded again
    in a second part, the two summed (as a GGUF's Q8_0 head runs)."""
    from conftest import tiny_target

    target = tiny_target(kind, runtime="hf", **overrides)
    assert quantise_model(target.model, torch.float32) == 7 * TINY["num_hidden_layers"]
    if head_parts:
        weight, parts = target.model.lm_head.weight.detach().float(), []
        for _ in range(head_parts):
            q, scale, zero = quantise(weight)
            parts.append(Int4Weight.from_ints(q, scale, zero, torch.float32))
            weight = weight - dequantise(q, scale, zero)
        # with its dense copy, as a GGUF target's: a drafter reads the head's rows
        target.model.lm_head = Int4Linear(parts, weight=Int4Linear(parts).dense_weight())
    return Target(target.model, name=target.name, runtime=runtime, weights="int4")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama/wide"])
def test_int4_static_runtime_gives_the_int4_models_own_logits(kind):
    kind, _, wide = kind.partition("/")
    target = int4_tiny(kind, **(WIDE if wide else {}))
    assert target.runtime == "static"
    assert (target.static.layers[0].qkv.int4 is not None) == bool(wide)  # fused, or run one by one
    rng = random.Random(0)
    for n in (1, 5, 17):
        check_tree_logits(target, [rng.randrange(96) for _ in range(9)], random_tree(rng, 96, n), atol=FP32_ATOL)


@pytest.mark.parametrize("seed", range(2))
def test_methods_match_ar_on_an_int4_target(seed):
    target = int4_tiny()
    rng = random.Random(seed)
    prompt = repetitive_prompt(rng, 96)
    ar = generate(target, make_drafter("ar"), prompt, max_new_tokens=40).tokens
    for budget in (4, 16):
        assert generate(target, make_drafter("pld"), prompt, 40, budget=budget).tokens == ar
        oracle = OracleTreeDrafter(ar, len(prompt), 96, seed=seed)
        assert generate(target, oracle, prompt, 40, budget=budget).tokens == ar


def test_the_cache_of_4bit_weights_reads_back_what_it_saved_and_refuses_what_does_not_fit(tmp_path, caplog,
                                                                                          monkeypatch):
    """A GGUF's 4-bit weights saved by `write_cache` read back bit for bit, with the report; a file for other
    products' dtype, for a model without those modules, made by other code, or damaged, reads as None (the GGUF
    is read again)."""
    from treeflash.runtime import gguf_int4

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    linears = {}
    for i, (name, kind) in enumerate((("0", "Q4_1"), ("1", "Q8_0"))):
        parts = [Int4Weight.from_ints(*quantise(torch.randn(model[i].out_features, model[i].in_features)),
                                      torch.bfloat16) for _ in range(1 if kind == "Q4_1" else 2)]
        linears[name] = (kind, parts)
    report = GGUFWeights(quantised=Counter({"Q4_1": 1, "Q8_0": 1}), dense=Counter({"Q6_K": 3}), int4_bytes=1234)
    path = tmp_path / "int4.safetensors"
    write_cache(path, linears, report)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written whole, then renamed
    read, read_report = read_cache(path, model, torch.bfloat16)
    assert read_report == report
    assert read.keys() == linears.keys()
    for name, (kind, parts) in linears.items():
        assert read[name][0] == kind and len(read[name][1]) == len(parts)
        for a, b in zip(parts, read[name][1]):
            assert torch.equal(a.packed, b.packed) and torch.equal(a.scale_zeros, b.scale_zeros)
    assert read_cache(path, model, torch.float32) is None  # the scales are in the products' dtype
    assert read_cache(path, torch.nn.Sequential(torch.nn.Linear(64, 32)), torch.bfloat16) is None
    with monkeypatch.context() as m:
        m.setattr(gguf_int4, "cache_format", lambda: "made by other code")
        assert read_cache(path, model, torch.bfloat16) is None
    path.write_bytes(path.read_bytes()[:1000])
    assert read_cache(path, model, torch.bfloat16) is None
    assert "reading the GGUF again" in caplog.text


@pytest.mark.real
def test_a_later_start_reads_the_cached_4bit_weights_instead_of_the_gguf(tmp_path, monkeypatch):
    """The first load of the embedded GGUF on the int4 kernel caches its 4-bit weights; a later load takes them
    from the cache without opening the GGUF, and the model is the same: the same weights, logits and report."""
    from treeflash.runtime import gguf_int4, target as target_module

    monkeypatch.setattr(target_module, "int4_cache_file", lambda gguf, dtype: tmp_path / "int4.safetensors")
    first = Target.load("smollm2-135m-instruct", dtype="bfloat16", quantize="gguf")
    assert (tmp_path / "int4.safetensors").exists()

    def unread(*args, **kwargs):
        raise AssertionError("the GGUF was read again")
    monkeypatch.setattr(gguf_int4, "GGUFReader", unread)
    second = Target.load("smollm2-135m-instruct", dtype="bfloat16", quantize="gguf")
    assert second.weights == first.weights
    ids = first.encode_prompt("What is 7 times 8?")
    logits = [t.prefill(ids).logits for t in (first, second)]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["bfloat16", "auto/avx2"])
def test_smollm2_keeps_its_gguf_blocks_and_stays_close_to_the_dequantised_model(smollm2, dtype, monkeypatch):
    """The embedded Q4_1 target on the int4 kernel against its dequantised fp32 copy (the exact reference): every
    product is 4-bit, the logits agree within the named tolerance. With bf16 activations (the CLI's default where
    bf16 is native), and with the fp32 activations that dtype auto keeps on CPUs without it (AVX2 only)."""
    if dtype == "auto/avx2":
        monkeypatch.setattr("treeflash.runtime.loading.native_bf16", lambda device: False)
        target = Target.load("smollm2-135m-instruct", dtype="auto")
        assert target.dtype == torch.float32
    else:
        target = Target.load("smollm2-135m-instruct", dtype=dtype, quantize="gguf")
    assert target.weights.quantised == {"Q4_1": 210, "Q8_0": 1} and not target.weights.dense
    assert target.weights.kernel_dtype == "bfloat16"
    assert smollm2.weights == "dense"  # an explicit float32 stays the exact path
    assert target.int4_products and not smollm2.int4_products  # its drafters go 4-bit, the exact path's stay dense
    assert not any(type(m) is torch.nn.Linear for m in target.model.modules())
    ids = target.encode_prompt("What is 7 times 8? Answer briefly.")
    tree = DraftTree.chain(ids[-1], [28, 29, 30])
    logits = []
    for t in (target, smollm2):
        t.prefill(ids[:-1])
        logits.append(t.verify(tree).logits)
        t.discard()
    torch.testing.assert_close(logits[0], logits[1], atol=BF16_LOGIT_ATOL, rtol=0)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_drafters_of_a_4bit_target_multiply_4bit_weights(tmp_path, monkeypatch):
    """Where the target's products are 4-bit in bf16 (`Target.int4_products`, the CPU's fast path), the drafter's
    linears are rounded to 4 bits for the same kernel, each keeping its rounded weight as a dense copy for its
    readers; elsewhere (here: fp32 activations, the exact path) the drafter stays as trained."""
    from test_dflash import tiny_drafter
    from treeflash.drafters.load import load_drafter_model

    target = int4_tiny(**WIDE)
    tiny_drafter(target).save_pretrained(tmp_path, dtype=torch.float32)
    assert not target.int4_products
    assert not any(isinstance(m, Int4Linear) for m in load_drafter_model(target, tmp_path).modules())
    monkeypatch.setattr(Target, "int4_products", property(lambda self: True))
    model = load_drafter_model(target, tmp_path)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 1 + 7 * len(model.layers) and model.fc in linears and model.head_int4
    with torch.no_grad():  # (inference)
        model.top_tokens(torch.randn(3, model.config.hidden_size), 2)
    assert isinstance(model._head_cast[2], Int4Linear)  # the head's rows it scores, rounded too
    for m in linears:  # the copy is the kernel's weight, up to the rounding of its scales to bf16
        torch.testing.assert_close(m.weight.float(), m.dense_weight(), atol=BF16_SCALE_ATOL, rtol=0)


def test_many_rows_run_on_the_second_layout_with_the_same_weights():
    """From DENSE_ROWS rows on, a fused 4-bit projection multiplies by a dense packed copy of the kernel's own
    weights: the same products within fp32 rounding."""
    from treeflash.runtime.static_decoder import DENSE_ROWS, _Projection

    linears = [Int4Linear([random_int4(n, 64, torch.float32, seed=n)[0]]) for n in (128, 64)]
    separate = [Int4Linear(list(m.parts)) for m in linears]  # the same weights, kept out of the fusion
    projection = _Projection(linears, torch.float32)
    assert projection.int4 is not None and projection.packed is not None
    x = torch.randn(DENSE_ROWS[torch.float32] + 3, 64)
    expected = torch.cat([m(x) for m in separate], dim=-1)
    torch.testing.assert_close(projection(x), expected, atol=FP32_ATOL, rtol=FP32_RTOL)  # dense layout
    torch.testing.assert_close(projection(x[:2]), expected[:2], atol=FP32_ATOL, rtol=FP32_RTOL)  # int4 kernel


def test_fp32_activations_of_a_bf16_kernel_get_an_fp32_second_layout():
    """Without native bf16, dtype auto keeps fp32 activations around bf16 4-bit products; products of many rows
    run on an fp32 packed copy of the kernel's weights, which skips the rounding of the inputs to bf16."""
    from treeflash.runtime.static_decoder import DENSE_ROWS, _Projection

    linear = Int4Linear([random_int4(64, 64, torch.bfloat16, seed=3)[0]])
    projection = _Projection([linear], torch.float32)
    assert projection.packed is not None and projection.packed.dtype == torch.float32
    x = torch.randn(DENSE_ROWS[torch.float32], 64)
    with torch.inference_mode():  # (with autograd on, every product takes the kernel)
        exact = x @ linear.dense_weight().T  # the kernel's own weights, in fp32
        torch.testing.assert_close(projection(x), exact, atol=FP32_ATOL, rtol=FP32_RTOL)  # dense layout
        assert torch.equal(projection(x[:2]), linear(x[:2]))  # few rows: the kernel, inputs rounded to bf16
