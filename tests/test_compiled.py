"""The compiled decoder layer (`models/compiled_layer.py`, `--compile`) against the eager reference
(`static_decoder.decoder_layer`): the same logits within fp32 rounding for trees, batches and every row count it
takes, the same tokens for every method, few graphs, and a clear refusal where it has no compiled form. The same
for the drafter's compiled block forward and catch-up (`models/compiled_block.py`) against `DFlashDrafter.hidden`,
`fuse` and `context_kv`."""

import os
import random
import shutil
import time

import pytest
import torch

from treeflash import DraftTree, Target, generate
from treeflash.batching import BatchTarget
from treeflash.drafters import block_drafter, make_drafter
from treeflash.drafters.load import compiled_like
from treeflash.models.dflash import ContextCache
from treeflash.runtime.static_decoder import COMPILED_ROWS, DENSE_COMPILED_ROWS
from treeflash.runtime import TargetError, aoti, int4
from treeflash.tree import random_tree

from conftest import OracleTreeDrafter, tiny_target
from test_dflash import tiny_drafter
from test_int4 import BF16_LOGIT_ATOL, FP32_ATOL, WIDE, int4_tiny
from test_lossless import repetitive_prompt
from test_target import check_tree_logits

# the compiled layer's attention is two fp32 reductions and a softmax, SDPA's another summation order
COMPILED_FP32_ATOL = 5 * FP32_ATOL
needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                                    reason="inductor's C++ wrapper needs g++ or clang++")


@pytest.fixture(scope="module")
def compiled() -> Target:
    """A tiny random Llama whose fused projections and LM head (two parts, as a Q8_0 head) run on the int4 kernel
    (fp32 activations), compiled."""
    target = int4_tiny("llama", head_parts=2, **WIDE)
    assert target.compile("on") and target.compiled and target.static.compiled_head
    return target


def eager_logits(target: Target, prompt: list[int], tree: DraftTree) -> torch.Tensor:
    with target.eager():
        target.prefill(prompt)
        out = target.verify(tree).logits
        target.discard()
    return out


@needs_compiler
def test_compiled_trees_equal_eager_ones_at_every_row_count_it_takes(compiled, monkeypatch):
    rng = random.Random(0)
    assert compiled.static.compiled_rows == DENSE_COMPILED_ROWS and compiled.static.dense_layer
    assert 0 <= compiled.static.int4_rows <= COMPILED_ROWS  # measured on this machine
    monkeypatch.setattr(compiled.static, "int4_rows", 3)  # every form, whatever the machine
    monkeypatch.setattr(compiled.static, "sdpa_rows", 2)
    sdpa, rows_by_sdpa = compiled.static.sdpa_layer, set()
    monkeypatch.setattr(compiled.static, "sdpa_layer", lambda x, *args: rows_by_sdpa.add(x.shape[1]) or sdpa(x, *args))
    head, rows_by_head = compiled.static.compiled_head, set()
    monkeypatch.setattr(compiled.static, "compiled_head", lambda x: rows_by_head.add(x.shape[1]) or head(x))
    monkeypatch.setattr(compiled.static.lm_head, "dense_rows", 3)  # the compiled 4-bit head for 1-2 rows
    # the 4-bit kernel's layer (its own attention for 1 row, SDPA's for 2-3), the dense copies' from 4 rows, eager
    # again past the last compiled row count
    for n in [1, 2, 3, 4, 5, 9, 17, DENSE_COMPILED_ROWS, DENSE_COMPILED_ROWS + 1]:
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 30))]
        tree = random_tree(rng, 96, n)
        compiled.prefill(prompt)
        out = compiled.verify(tree).logits
        compiled.discard()
        torch.testing.assert_close(out, eager_logits(compiled, prompt, tree), atol=COMPILED_FP32_ATOL, rtol=0)
        check_tree_logits(compiled, prompt, tree, atol=COMPILED_FP32_ATOL)  # against its own sequential steps
    assert rows_by_sdpa == {2, 3} and rows_by_head == {1, 2}


@needs_compiler
@pytest.mark.parametrize("int4_rows", [COMPILED_ROWS, 0])  # the 4-bit kernel's layer, the dense copies'
def test_compiled_batches_equal_eager_ones(compiled, monkeypatch, int4_rows):
    """Uneven lengths (indexed cache writes, masks for single tokens) and mixed tree sizes, over several rounds."""
    monkeypatch.setattr(compiled.static, "int4_rows", int4_rows)
    rng = random.Random(1)
    histories = [repetitive_prompt(rng, 96, n) for n in (7, 19, 12)]
    batches = [BatchTarget(compiled, max_batch=3, capacity=64) for _ in range(2)]
    with compiled.eager():
        for h in histories:
            batches[1].add(h)
    for h in histories:
        batches[0].add(h)
    for _ in range(3):
        sizes = [rng.choice([1, 1, 2]) for _ in histories]  # B * n within the compiled rows
        trees = [random_tree(rng, 96, n) for n in sizes]
        outs = batches[0].verify(trees)
        assert len(trees) * max(sizes) <= compiled.static.compiled_rows  # this ran compiled
        with compiled.eager():
            refs = batches[1].verify(trees)
        paths = [tree.path_to(rng.randrange(len(tree))) for tree in trees]
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out.logits, ref.logits, atol=COMPILED_FP32_ATOL, rtol=0)
        for batch in batches:
            batch.commit(paths)


@needs_compiler
def test_methods_on_a_compiled_target_give_the_eager_greedy_tokens(compiled):
    rng = random.Random(2)
    prompt = repetitive_prompt(rng, 96)
    with compiled.eager():
        ar = generate(compiled, make_drafter("ar"), prompt, max_new_tokens=40).tokens
    assert generate(compiled, make_drafter("ar"), prompt, max_new_tokens=40).tokens == ar
    for budget in (2, 4, 12):  # trees the compiled layers verify (12: on the dense copies)
        assert generate(compiled, make_drafter("pld"), prompt, 40, budget=budget).tokens == ar
        assert generate(compiled, OracleTreeDrafter(ar, len(prompt), 96), prompt, 40, budget=budget).tokens == ar


@needs_compiler
def test_a_second_start_loads_the_layer_without_building_it(compiled, monkeypatch):
    """One package per model shape and machine, whatever the lengths and batches: a second target of the same
    shape builds nothing and decodes as its eager layers do."""
    def no_build(*args, **kwargs):
        raise AssertionError("the layer was built again")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_build)
    again = int4_tiny("llama", head_parts=2, **WIDE)
    assert again.compile("on")
    prompt = repetitive_prompt(random.Random(3), 96)
    with again.eager():
        ar = generate(again, make_drafter("ar"), prompt, max_new_tokens=30).tokens
    assert generate(again, make_drafter("ar"), prompt, max_new_tokens=30).tokens == ar


def test_building_a_package_deletes_those_of_its_name_unused_for_a_month(tmp_path, monkeypatch):
    """Each upgrade keys new packages (the key holds the module's source): the old ones go once unused for
    STALE_DAYS, and loading one marks it used. The build and the loader are stand-ins: this is about the files."""
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda program, package_path: open(
        package_path, "wb").close())
    monkeypatch.setattr(aoti, "load", lambda path: lambda args: args)
    folder, month = tmp_path / "aoti", (aoti.STALE_DAYS + 1) * 86400
    folder.mkdir()
    old, recent, other = (folder / f"{name}-{digit * aoti.DIGEST}.pt2" for name, digit in (
        ("layer", "0"), ("layer", "1"), ("drafter-block", "0")))
    for path in (old, recent, other):
        path.touch()
    for path in (old, other):
        os.utime(path, (time.time() - month,) * 2)
    run = aoti.package("layer", ("a key",), export=lambda: None)
    assert run(1, 2) == [1, 2]
    built = set(folder.glob("layer-*.pt2")) - {recent}
    assert len(built) == 1 and not old.exists()
    assert recent.exists() and other.exists()  # other names stay
    built = built.pop()
    os.utime(built, (time.time() - month,) * 2)
    aoti.package("layer", ("a key",), export=lambda: None)  # loaded, not built: marked used, nothing deleted
    assert built.stat().st_mtime > time.time() - 60 and other.exists()


def test_targets_without_a_compiled_form_stay_eager_or_are_refused():
    dense, qwen3 = tiny_target("llama"), int4_tiny("qwen3")
    for target in (dense, qwen3, tiny_target("llama", runtime="hf")):
        assert not target.compile("auto") and not target.compiled
        with pytest.raises(TargetError, match="compile on"):
            target.compile("on")
    assert not dense.compile("off")


@pytest.mark.real
@needs_compiler
def test_smollm2_compiled_stays_within_bf16_rounding_of_eager():
    """The embedded Q4_1 target as the command line runs it (bf16, the GGUF's blocks, compiled) against its eager
    layers: the same model, another rounding (bf16 attention and norms fused otherwise)."""
    target = Target.load("smollm2-135m-instruct", dtype="bfloat16", compile="on")
    assert target.compiled
    ids = target.encode_prompt("What is 7 times 8? Answer briefly.")
    for tree in (DraftTree.chain(ids[-1]), DraftTree.chain(ids[-1], [28, 29, 30])):
        target.prefill(ids[:-1])
        out = target.verify(tree).logits
        target.discard()
        torch.testing.assert_close(out, eager_logits(target, ids[:-1], tree), atol=BF16_LOGIT_ATOL, rtol=0)


def test_a_failing_toolchain_leaves_auto_eager(monkeypatch, tmp_path):
    """Where inductor cannot build the layer (a compiler without Python's headers, ...), auto decodes eager and on
    says why."""
    def broken(*args, **kwargs):
        raise RuntimeError("C++ compile error\nPython.h: No such file or directory")
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))  # no package built before
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    target = int4_tiny("llama", **WIDE)
    assert not target.compile("auto") and not target.compiled and target.static.compiled_rows == 0
    prompt = repetitive_prompt(random.Random(4), 96)
    assert len(generate(target, make_drafter("ar"), prompt, max_new_tokens=8).tokens) == 8
    with pytest.raises(TargetError, match="compiling the layer failed: C\\+\\+ compile error"):
        target.compile("on")


@pytest.fixture(scope="module")
def compiled_drafter(compiled):
    """A tiny random fp32 drafter of the compiled target, its block forward compiled as `make_drafter` does."""
    model = compiled_like(compiled, tiny_drafter(compiled).eval())
    assert model.compiled_block is not None
    return model


def draft_both(model, root: int, cache: ContextCache, depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's drafted states, compiled (its last layer on the first depth + 1 positions only) and eager (every
    position, the first `depth` kept; it writes scratch after the context only)."""
    out = model.draft_states(root, len(cache), cache, depth)
    block, model.compiled_block = model.compiled_block, None
    try:
        return out, model.draft_states(root, len(cache), cache, depth)
    finally:
        model.compiled_block = block


def eager_context_states(model, taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`context_states` through its eager reference (`fuse`, `context_kv`)."""
    compiled, model.compiled_context = model.compiled_context, None
    try:
        return model.context_states(taps, positions)
    finally:
        model.compiled_context = compiled


@pytest.fixture(scope="module")
def compiled_short_drafter(compiled):
    """As `compiled_drafter`, trained for short blocks: its block is the rows a tree reads."""
    drafter = tiny_drafter(compiled, seed=1)
    drafter.config.short_blocks = True
    return compiled_like(compiled, drafter.eval())


@pytest.fixture(scope="module")
def compiled_int4_drafter(compiled):
    """As `compiled_drafter`, its linears rounded to 4 bits (what `load_drafter_model` does where the target's are):
    its compiled forwards multiply on the int4 kernel (here with fp32 scales, as the tiny target's)."""
    drafter = tiny_drafter(compiled, seed=2)
    assert int4.quantise_linears(drafter, torch.float32, keep_weight=True) == 1 + 7 * len(drafter.layers)
    model = compiled_like(compiled, drafter.eval())
    assert model.compiled_block is not None and model.compiled_context is not None
    assert model.compiled_block[1][3].dtype == torch.uint8  # q|k|v: the 4-bit kernel's packed values
    return model


@needs_compiler
@pytest.mark.parametrize("drafter", ["compiled_drafter", "compiled_short_drafter", "compiled_int4_drafter"])
def test_compiled_block_and_catch_up_equal_eager_over_contexts_that_grow(drafter, request):
    """Context lengths, catch-up lengths, depths and cache capacities it was not traced with (one package takes
    them all: its sizes are symbolic); a short-block drafter's block of depth + 1 positions likewise."""
    model, rng = request.getfixturevalue(drafter), random.Random(5)
    assert model.compiled_context is not None
    cache = ContextCache(model, capacity=8)
    depths = (None, 1, 5, 2, model.config.block_size)  # every drafted position, or the first few (more: all)
    # 8 -> 16 -> 64: the buffers double as the context grows; 40 new positions: a 4-bit drafter's dense catch-up
    for new, depth in zip((2, 1, 9, 2, 40), depths):
        taps = torch.randn(new, len(model.config.target_layer_ids), model.config.hidden_size)
        positions = torch.arange(len(cache), len(cache) + new)
        states = model.context_states(taps, positions)
        for out, ref in zip(states, eager_context_states(model, taps, positions)):
            torch.testing.assert_close(out, ref, atol=COMPILED_FP32_ATOL, rtol=0)
        cache.append(*states[1:])
        out, ref = draft_both(model, rng.randrange(96), cache, depth)
        assert len(out) == min(depth or model.config.block_size, model.config.block_size - 1)
        torch.testing.assert_close(out, ref, atol=COMPILED_FP32_ATOL, rtol=0)


@needs_compiler
def test_a_context_that_fills_its_cache_exactly(compiled_drafter):
    """A long prompt's catch-up grows the cache to what it needs: the block reads a cache its context fills."""
    model = compiled_drafter
    cache = ContextCache(model, capacity=8)
    taps = torch.randn(64, len(model.config.target_layer_ids), model.config.hidden_size)
    cache.append(*model.context_states(taps, torch.arange(64))[1:])  # 8 -> 64 positions
    assert cache.k.shape[2] == len(cache)
    out, ref = draft_both(model, 3, cache, 4)
    torch.testing.assert_close(out, ref, atol=COMPILED_FP32_ATOL, rtol=0)


@needs_compiler
@pytest.mark.parametrize("drafter", ["compiled_drafter", "compiled_int4_drafter"])
def test_a_compiled_drafter_gives_the_greedy_tokens(compiled, drafter, request):
    prompt = repetitive_prompt(random.Random(6), 96)
    ar = generate(compiled, make_drafter("ar"), prompt, max_new_tokens=40).tokens
    model = request.getfixturevalue(drafter)
    for method in ("dflash", "ddtree"):
        assert generate(compiled, block_drafter(model, method), prompt, 40, budget=4).tokens == ar


def test_drafters_without_a_compiled_form_or_toolchain_draft_eager(compiled, monkeypatch, caplog, tmp_path):
    learned_mask = tiny_drafter(compiled, mask_token_id=None)
    assert compiled_like(compiled, learned_mask).compiled_block is None
    assert compiled_like(tiny_target("llama"), tiny_drafter(compiled)).compiled_block is None  # target eager
    partly_int4 = tiny_drafter(compiled)  # the compiled forwards index a product's tensors by one count for all
    int4.quantise_linears(partly_int4.layers[0].mlp, torch.float32, keep_weight=True)
    assert compiled_like(compiled, partly_int4).compiled_block is None

    def broken(*args, **kwargs):
        raise RuntimeError("C++ compile error\nPython.h: No such file or directory")
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))  # no package built before
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    model = compiled_like(compiled, tiny_drafter(compiled))
    assert model.compiled_block is None and model.compiled_context is None
    assert "drafting eager: C++ compile error" in caplog.text
