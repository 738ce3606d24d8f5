"""DFlash2: the published checkpoint format, checked against the reference implementation (PyPI `dflash` 0.1.0,
`DFlash2DraftModel`; installed without its dependencies by scripts/setup.sh, the parity tests are skipped where it
is missing), the save / load round trip, and the identity at initialisation."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from treeflash.models.dflash import ContextCache, DFlashDrafter
from treeflash.models.dflash_config import DFlashConfig
from treeflash.models.dflash2 import DFlash2Config, DFlash2Drafter, is_dflash2, walk
from conftest import tiny_target
from test_cli import tiny_folder  # noqa: F401  (fixture)

PARITY_ATOL, PARITY_RTOL = 1e-5, 1e-4  # fp32, two implementations of the same forward
Q_ATOL = 1e-5  # the selector's distributions over the K candidates

H, I, LAYERS, HEADS, KV_HEADS, HEAD_DIM, V = 64, 96, 2, 4, 2, 16, 96
TAPS, BLOCK, MASK = [0, 2], 6, 95
KC, GS, RANK, TOP_K = 3, 16, 8, 6
SCALE, MULTIPLIER, SOFTCAP = 1.5, 4.0, 3.0
CONTEXT, ROOT = 9, 42


def published_config() -> dict:
    """A DFlash2 config as the reference reads it: Qwen3 fields, `dflash_config`, and one DFlash2 key at the top
    level (the reference reads each key from dflash_config, else from the top level)."""
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "vocab_size": V, "rms_norm_eps": 1e-6, "num_target_layers": 3,
            "rope_theta": 10000.0, "max_position_embeddings": 512, "final_logit_softcapping": SOFTCAP,
            "dflash_config": {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": TAPS,
                              "conv_kernel_size": KC, "conv_group_size": GS, "selector_rank": RANK,
                              "selector_top_k": TOP_K, "input_embedding_scale": SCALE,
                              "output_multiplier": MULTIPLIER}}


def published_shapes() -> dict[str, tuple[int, ...]]:
    """The reference's tensor names (codebooks without `.weight`) and shapes."""
    groups = H // GS
    shapes = {"fc.weight": (H, len(TAPS) * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "candidate_selector.predecessor_codebook": (V, RANK),
              "candidate_selector.successor_codebook": (V, RANK),
              "candidate_selector.hidden_projection.weight": (RANK, H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
                       p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
                       p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + conv + ".base_kernel"] = (2, KC, H)
            shapes[p + conv + ".kernel_projection.weight"] = (2 * KC * groups, H)
    return shapes


def random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights away from every initial value: norms not 1, convs not the identity (all taps, dynamic
    kernels), both codebooks non-zero, so that a conv or selector term applied wrongly (or not at all) shows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in published_shapes().items():
        x = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            x = 1 + 0.2 * x
        elif name.endswith("base_kernel"):
            x = 0.5 * x
        elif name.endswith("kernel_projection.weight"):
            x = 0.3 * x
        elif name.startswith("candidate_selector."):
            pass  # N(0, 1): pairwise terms as large as the unary logits' gaps
        else:
            x = 0.02 * x
        out[name] = x
    return out


def write_published(folder, weights=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(published_config()))
    save_file(weights or random_weights(), str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def reference():
    return pytest.importorskip("dflash.model", reason="the reference `dflash` package is not installed")


def context_taps(target, seed: int = 0):
    """A random prompt's hidden states from the target: the HF outputs (what the reference reads) and our taps."""
    prompt = torch.randint(0, V, (1, CONTEXT), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target.model(prompt, output_hidden_states=True)
    ours = torch.stack([out.hidden_states[i + 1][0] for i in TAPS], dim=1)  # [C, n_taps, H]
    return out.hidden_states, ours


def their_states(reference, theirs, target, hidden_states, roots):
    """The reference's final (normed) block states [B, γ, H] of blocks [root, mask...] after the context."""
    feature = reference.extract_context_feature(hidden_states, theirs.target_layer_ids)
    block = torch.tensor([[r] + [MASK] * (BLOCK - 1) for r in roots])
    noise = F.embedding(block, target.model.get_input_embeddings().weight) * SCALE  # as dflash_generate embeds
    with torch.no_grad():
        return theirs(position_ids=torch.arange(CONTEXT + BLOCK)[None], noise_embedding=noise,
                      target_hidden=feature)


def our_states(ours, taps, root):
    kv = ours.context_kv(ours.fuse(taps), torch.arange(CONTEXT))
    return ours.draft_states(root, CONTEXT, kv)  # pre-norm [γ - 1, H]


def test_the_config_reads_as_the_reference_reads_it(tmp_path):
    folder = write_published(tmp_path / "d")
    assert is_dflash2(folder)
    c = DFlash2Drafter.from_pretrained(folder).dflash2
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (KC, GS, RANK, TOP_K)
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (SCALE, MULTIPLIER, SOFTCAP)
    b = c.backbone
    assert (b.block_size, b.mask_token_id, b.target_layer_ids, b.rope_theta) == (BLOCK, MASK, TAPS, 10000.0)


def test_reference_and_ours_agree_on_a_published_checkpoint(tmp_path, target, reference):
    """The same folder loaded by the reference DFlash2DraftModel and by DFlash2Drafter: the same block states,
    the same candidates, the same T = 0 chain and the same q rows at T > 0 (fp32)."""
    folder = write_published(tmp_path / "d")
    weights = random_weights()
    theirs = reference.DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = theirs.state_dict()
    for name, x in weights.items():  # every tensor reached the reference under its published name
        key = name + ".weight" if name.startswith("candidate_selector.") and "codebook" in name else name
        torch.testing.assert_close(loaded[key], x, atol=0, rtol=0)
    ours = DFlash2Drafter.from_pretrained(folder).attach(target.model)
    hidden_states, taps = context_taps(target)

    expected = their_states(reference, theirs, target, hidden_states, [ROOT])[0]
    h = our_states(ours, taps, ROOT)
    torch.testing.assert_close(ours.norm(h), expected[1:], atol=PARITY_ATOL, rtol=PARITY_RTOL)

    head = target.model.lm_head
    path, their_cand, _ = theirs.propose(expected[None, 1:], torch.tensor([ROOT]), head, 0.0)
    cand, scores = ours.selector_tables(ROOT, h)
    tokens, _, _ = walk(cand, scores)
    assert tokens == path[0].tolist()
    assert torch.equal(cand.sort(-1).values, their_cand[0].sort(-1).values)
    assert tokens != cand[:, 0].tolist(), "the selector should change some choice here, or the test cannot fail"

    T = 0.7
    torch.manual_seed(0)
    path, their_cand, their_q = theirs.propose(expected[None, 1:], torch.tensor([ROOT]), head, T)
    parents = [ROOT] + path[0, :-1].tolist()  # their sampled chain: our q rows given the same parents
    for d, parent in enumerate(parents):
        row = 0 if d == 0 else cand[d - 1].tolist().index(parent)
        q = torch.softmax(scores[d, row] / T, dim=-1)
        theirs_by_token = dict(zip(their_cand[0, d].tolist(), their_q[0, d].tolist()))
        torch.testing.assert_close(q, torch.tensor([theirs_by_token[t] for t in cand[d].tolist()]), atol=Q_ATOL,
                                   rtol=0)


def test_batched_drafting_equals_the_reference_batch(tmp_path, target, reference):
    """Two sequences drafted in one forward (our padded batch over ContextCaches; the reference's batch)."""
    folder = write_published(tmp_path / "d")
    theirs = reference.DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = DFlash2Drafter.from_pretrained(folder).attach(target.model)
    (hs0, taps0), (hs1, taps1) = context_taps(target, 0), context_taps(target, 1)
    both = tuple(torch.cat([a, b]) for a, b in zip(hs0, hs1))
    expected = their_states(reference, theirs, target, both, [ROOT, 7])[:, 1:]
    caches = []
    for taps in (taps0, taps1):
        cache = ContextCache(ours)
        cache.append(*ours.context_states(taps, torch.arange(CONTEXT))[1:])
        caches.append(cache)
    h = ours.draft_states_batch([ROOT, 7], caches)
    torch.testing.assert_close(ours.norm(h), expected, atol=PARITY_ATOL, rtol=PARITY_RTOL)
    torch.testing.assert_close(ours.draft_states(ROOT, CONTEXT, caches[0]), h[0], atol=PARITY_ATOL,
                               rtol=PARITY_RTOL)


def test_the_convs_matter_here(tmp_path, target):
    """With the identity convs the states change: the parity above checks the convs, not only the backbone."""
    ours = DFlash2Drafter.from_pretrained(write_published(tmp_path / "d")).attach(target.model)
    _, taps = context_taps(target)
    h = our_states(ours, taps, ROOT)
    with torch.no_grad():
        for layer in ours.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1
                conv.kernel_projection.weight.zero_()
    assert (our_states(ours, taps, ROOT) - h).abs().max() > 1e-2


def test_save_load_round_trip_and_the_published_layout(tmp_path, target, reference):
    """save_pretrained writes what the reference reads: the published folder's names, shapes and config values;
    loading it back gives the same weights exactly (fp32) and the reference drafts the same states from it."""
    src = write_published(tmp_path / "published")
    model = DFlash2Drafter.from_pretrained(src)
    model.save_pretrained(tmp_path / "ours", dtype=torch.float32)
    again = DFlash2Drafter.from_pretrained(tmp_path / "ours")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, atol=0, rtol=0)
    assert again.dflash2 == model.dflash2

    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in written.items()} == published_shapes()
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    want = {**published_config()["dflash_config"], "final_logit_softcapping": SOFTCAP}
    assert config["dflash_config"] == want

    theirs = reference.DFlash2DraftModel.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    hidden_states, taps = context_taps(target)
    expected = their_states(reference, theirs, target, hidden_states, [ROOT])[0, 1:]
    ours = again.attach(target.model)
    torch.testing.assert_close(ours.norm(our_states(ours, taps, ROOT)), expected, atol=PARITY_ATOL,
                               rtol=PARITY_RTOL)

    model.save_pretrained(tmp_path / "bf16")  # the shipping dtype
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_a_fresh_drafter_is_dflash(target):
    """At initialisation the convs are the identity and the successor codebook is 0: the states are the DFlash
    backbone's and the selector's scores are the unary logits (the chain is the marginals' argmax)."""
    torch.manual_seed(0)
    config = DFlash2Config.for_target(target.config, conv_kernel_size=KC, conv_group_size=GS, selector_rank=RANK,
                                      selector_top_k=TOP_K, num_layers=LAYERS, num_taps=2, block_size=BLOCK,
                                      mask_token_id=MASK)
    fresh = DFlash2Drafter(config).attach(target.model)
    backbone = DFlashDrafter(DFlashConfig(**vars(config.backbone))).attach(target.model)
    own = {k: v for k, v in fresh.state_dict().items() if k in backbone.state_dict()}
    backbone.load_state_dict(own)  # every DFlash tensor; the rest are DFlash2's
    assert set(fresh.state_dict()) - set(own) == {k for k in fresh.state_dict()
                                                  if "_conv." in k or k.startswith("candidate_selector.")}
    taps = torch.randn(CONTEXT, 2, H)
    h = our_states(fresh, taps, ROOT)
    torch.testing.assert_close(h, our_states(backbone, taps, ROOT), atol=1e-6, rtol=1e-5)
    cand, scores = fresh.selector_tables(ROOT, h)
    torch.testing.assert_close(scores, fresh.logits(h).float().topk(TOP_K).values[:, None, :].expand_as(scores))
    assert walk(cand, scores)[0] == backbone.logits(h).argmax(-1).tolist()


def test_export_writes_the_reference_layout(tmp_path, target, reference):
    """`treeflash export` of a DFlash2 folder: the published layout (bf16, as shipped), which the reference loads."""
    from safetensors.torch import load_file

    from treeflash.cli import main

    src = write_published(tmp_path / "published")
    assert main(["export", str(src), "--to", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    written = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in written.items()} == published_shapes()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert "DFlash2DraftModel.from_pretrained" in (out / "README.md").read_text()
    theirs = reference.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    for k, v in written.items():
        key = k + ".weight" if k in ("candidate_selector.predecessor_codebook",
                                     "candidate_selector.successor_codebook") else k
        torch.testing.assert_close(theirs.state_dict()[key], v.float(), atol=0, rtol=0)
        torch.testing.assert_close(v.float(), random_weights()[k].to(torch.bfloat16).float(), atol=0, rtol=0)


# ---- method dflash2 through the engines ---------------------------------------------------------------------------

def dflash2_folder(folder, target, seed: int = 1, block_size: int = 8, top_k: int = 6):
    """A random DFlash2 drafter for `target` (its last token id as the mask), with non-trivial convs and selector."""
    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    config = DFlash2Config.for_target(target.config, conv_kernel_size=KC, conv_group_size=GS, selector_rank=RANK,
                                      selector_top_k=top_k, num_layers=2, num_taps=2, block_size=block_size,
                                      mask_token_id=vocab - 1)
    model = DFlash2Drafter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("base_kernel", "kernel_projection.weight")):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.startswith("candidate_selector."):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(folder, dtype=torch.float32)
    return folder


@pytest.mark.parametrize("kind,method", [("llama", "dflash2"), ("qwen3", "dflash2"), ("llama", "dflash2-tree"),
                                         ("qwen3", "dflash2-tree")])
def test_dflash2_matches_ar(tmp_path, kind, method):
    """T = 0: the selector's argmax chain, and the OPT-Tree over its tables, verified, give exactly the target's
    greedy tokens (fp32), alone and batched (mixed lengths and limits, more prompts than slots)."""
    import random

    from treeflash import generate
    from treeflash.batching import BatchEngine
    from treeflash.drafters import make_drafter

    from test_lossless import repetitive_prompt

    target = tiny_target(kind)
    drafter = make_drafter(method, target, str(dflash2_folder(tmp_path / "d", target)))
    assert drafter.name == method
    prompts = [repetitive_prompt(random.Random(seed), 96, n) for seed, n in zip(range(4), (40, 12, 25, 33))]
    limits = [40, 9, 30, 1]
    ar = [generate(target, make_drafter("ar"), p, n).tokens for p, n in zip(prompts, limits)]
    for budget in (1, 5, 16, "auto"):
        for p, n, expected in zip(prompts, limits, ar):
            assert generate(target, drafter, p, n, budget=budget).tokens == expected, budget
    for budget in (3, 16):
        results = BatchEngine(target, drafter, max_batch=3, budget=budget).run(prompts, limits[0])
        assert [r.tokens[:n] for r, n in zip(results, limits)] == ar


def test_dflash2_tree_is_the_best_tree_over_the_selector_tables(tmp_path):
    """dflash2-tree's tree is a real tree (not the chain), and its expected accepted length under the selector's
    conditionals is at least the reference chain's, which is one of the trees of that size."""
    from treeflash.drafters import make_drafter
    from treeflash.trees.opt_tree import tree_value

    target = tiny_target("llama")
    folder = str(dflash2_folder(tmp_path / "d", target))
    tree_drafter, chain_drafter = (make_drafter(m, target, folder) for m in ("dflash2-tree", "dflash2"))
    torch.manual_seed(0)
    h = torch.randn(7, target.config.hidden_size, dtype=tree_drafter.model.fc.weight.dtype)
    cand, scores = tree_drafter.model.selector_tables(ROOT, h)
    cond = torch.softmax(scores, dim=-1)
    tree, chain = tree_drafter.tree([ROOT], h, 7), chain_drafter.tree([ROOT], h, 7)
    assert len(tree) == len(chain) == 8 and not tree.is_chain and chain.is_chain
    assert tree_value(tree, cand, cond) >= tree_value(chain, cand, cond) - 1e-6


def test_dflash2_without_a_folder_is_refused(tmp_path):
    from treeflash.drafters import make_drafter
    from treeflash.models.checkpoint import DrafterError

    target = tiny_target("llama")
    with pytest.raises(FileNotFoundError, match="no DFlash2 drafter ships"):
        make_drafter("dflash2", target)
    from test_dflash import tiny_drafter

    tiny_drafter(target).save_pretrained(tmp_path / "dflash")
    with pytest.raises(DrafterError, match="not a DFlash2 drafter"):
        make_drafter("dflash2", target, str(tmp_path / "dflash"))


def first_tokens(cand, q, logits, sampling, draws: int) -> torch.Tensor:
    """Counts [V] of the first token `accept` emits after the root, over many chains drawn from the proposal
    (cand, q) [D, K] (row d: the distribution of draft d + 1, whatever its parent), on fixed target logits."""
    from treeflash import DraftTree
    from treeflash.verify import accept

    g, counts = torch.Generator().manual_seed(1), torch.zeros(logits.shape[-1])
    for _ in range(draws):
        drafts = cand.gather(1, torch.multinomial(q, 1, generator=g))[:, 0].tolist()
        chain = DraftTree.chain(5, drafts, proposal=(cand, q))
        path, bonus = accept(chain, logits, sampling, g)
        counts[drafts[0] if len(path) > 1 else bonus] += 1
    return counts


@pytest.mark.parametrize("biased", [False, True])
def test_speculative_sampling_of_a_chain(biased, monkeypatch):
    """`accept` on a sampled chain (top-k / top-p target): the first emitted token is an exact sample of the
    target's processed distribution at the root, and drawing from p after a rejection (the control) is not."""
    from scipy.stats import chisquare

    import treeflash.verify
    from treeflash import Sampling

    if biased:
        monkeypatch.setattr(treeflash.verify, "residual", lambda p, ids, q: p)
    g = torch.Generator().manual_seed(0)
    cand = torch.stack([torch.randperm(10, generator=g)[:4] for _ in range(2)])
    q = torch.softmax(3 * torch.randn(2, 4, generator=g), -1)  # far from p: many rejections
    logits = 2 * torch.randn(3, 10, generator=g)
    sampling = Sampling(temperature=0.8, top_k=6, top_p=0.9)
    draws = 6000
    counts = first_tokens(cand, q, logits, sampling, draws)
    p = sampling.probs(logits[0])
    assert counts[p == 0].sum() == 0 or biased
    keep = p > 0
    pvalue = chisquare(counts[keep].numpy(), (p[keep] * draws).numpy()).pvalue
    assert (pvalue < 1e-6) if biased else (pvalue > 1e-3), pvalue


def test_expected_accepted_of_a_sampled_chain():
    """E[accepted | chain, q] = 1 + sum of the products of min(1, p / q): against the mean of `accept`."""
    from treeflash import DraftTree, Sampling
    from treeflash.verify import accept, expected_accepted

    g = torch.Generator().manual_seed(0)
    cand = torch.stack([torch.randperm(10, generator=g)[:4] for _ in range(3)])
    q = torch.softmax(torch.randn(3, 4, generator=g), -1)
    chain = DraftTree.chain(5, cand[:, 0].tolist(), q[:, 0].tolist(), proposal=(cand, q))
    logits = 2 * torch.randn(4, 10, generator=g)
    sampling = Sampling(temperature=1.0)
    expected = expected_accepted(chain, logits, sampling)
    counts = [len(accept(chain, logits, sampling, g)[0]) for _ in range(20000)]
    assert abs(sum(counts) / len(counts) - expected) < 0.02
    assert chain.prefix(2).proposal[0].shape == (2, 4)


# ---- training: treeflash train dflash2 -----------------------------------------------------------------------------

def test_a_dflash2_drafter_from_a_dflash_one_starts_as_it():
    """from_dflash: the convs start as the identity and the selector as plain unary scoring, so the new drafter's
    block states are the DFlash drafter's, and its selector chain is the DFlash argmax chain."""
    from test_dflash import tiny_drafter

    target = tiny_target("llama")
    dflash = tiny_drafter(target, block_size=6).eval()
    ours = DFlash2Drafter.from_dflash(dflash, conv_kernel_size=2, conv_group_size=16, selector_rank=RANK,
                                      selector_top_k=TOP_K).eval()
    tokens = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(0))
    taps = torch.randn(30, len(dflash.config.target_layer_ids), target.config.hidden_size)
    anchors = torch.tensor([3, 10, 20])
    with torch.no_grad():
        expected, h = dflash(anchors, tokens, taps), ours(anchors, tokens, taps)
        torch.testing.assert_close(h, expected, atol=0, rtol=0)
        cand, scores = ours.selector_tables(int(tokens[10]), h[1])
    assert walk(cand, scores)[0] == cand[:, 0].tolist() == dflash.logits(expected[1]).argmax(-1).tolist()


def test_a_few_dflash2_steps_learn():
    """dflash2_loss on one sequence: the backbone and the selector losses both fall; selector-only moves only the
    selector (and a frozen backbone's loss is not computed)."""
    from test_dflash import tiny_drafter

    from treeflash.train.dflash import Sequence, sample_anchors, target_view
    from treeflash.train.dflash2 import dflash2_loss

    target = tiny_target("llama")
    seq = Sequence(torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)), prompt_len=5)
    for selector_only in (False, True):
        model = DFlash2Drafter.from_dflash(tiny_drafter(target, block_size=4), conv_kernel_size=2,
                                           conv_group_size=16, selector_rank=RANK, selector_top_k=TOP_K)
        model.attach(target.model)
        view = target_view(target.model, seq.tokens, model.config.target_layer_ids)
        anchors = sample_anchors(seq, 16, torch.Generator().manual_seed(0))
        params = list((model.candidate_selector if selector_only else model).parameters())
        model.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optim = torch.optim.AdamW(params, lr=1e-2)
        first = None
        for _ in range(30):
            loss, stats = dflash2_loss(model, seq, view, anchors, backbone=not selector_only)
            optim.zero_grad()
            loss.backward()
            optim.step()
            first = first or {k: float(v) for k, v in stats.items()}
        assert float(stats["selector_loss"]) < 0.7 * first["selector_loss"], selector_only
        if selector_only:
            assert "backbone_loss" not in stats
            moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
            assert moved and all(k.startswith("candidate_selector.") for k in moved), sorted(moved)
        else:
            assert float(stats["backbone_loss"]) < 0.5 * first["backbone_loss"]


def test_train_dflash2_cli(tmp_path, tiny_folder):  # noqa: F811
    """`treeflash train dflash2` from a DFlash drafter trained by `train dflash`, selector-only and in full, then
    --init: each run writes a published-format folder that the dflash2 methods decode losslessly."""
    from test_train import train_args, write_store

    from treeflash import generate
    from treeflash.cli import main
    from treeflash.drafters import make_drafter
    from treeflash.runtime import Target

    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "dflash", 2)) == 0
    common = train_args(tmp_path, tiny_folder, tmp_path / "x", 2)[2:]
    common = [a for i, a in enumerate(common) if a not in ("--layers", "--taps") and
              common[i - 1] not in ("--layers", "--taps")]
    backbone = str(tmp_path / "dflash" / "drafter")
    runs = {"selector": ["--backbone", backbone, "--selector-only"], "full": ["--backbone", backbone],
            "more": ["--init", str(tmp_path / "full" / "drafter")]}
    for name, extra in runs.items():
        args = ["train", "dflash2", *common, *extra, "--selector-rank", "8", "--selector-top-k", "4"]
        args[args.index("--out") + 1] = str(tmp_path / name)
        assert main(args) == 0, name
        assert is_dflash2(tmp_path / name / "drafter")
    assert main(["train", "dflash2", *common, "--selector-only"]) == 2  # nothing to freeze
    assert main(["train", "dflash2", *common, "--init", backbone]) == 2  # not a DFlash2 drafter

    target = Target.load(tiny_folder, dtype="float32")
    prompt = target.encode_prompt("What is 2 times 2?")
    expected = generate(target, make_drafter("ar"), prompt, 24).tokens
    for method in ("dflash2", "dflash2-tree"):
        drafter = make_drafter(method, target, str(tmp_path / "more" / "drafter"))
        assert generate(target, drafter, prompt, 24, budget=8).tokens == expected, method
