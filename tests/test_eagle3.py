"""EAGLE-3 (models/eagle3.py, method eagle3, `train eagle3`): the dynamic tree's node probabilities against a plain
sequential run of the layer along each path, training-time test against the same reference (teacher-forced),
the greedy tokens of the target at every budget, the SpecForge layout on disk, and the command line end to end."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from treeflash import generate
from treeflash.cli import main
from treeflash.drafters import make_drafter
from treeflash.drafters.eagle3 import Eagle3Decoder
from treeflash.models.eagle3 import Eagle3Config, Eagle3Drafter, attend, attend_rows, eagle3_taps
from treeflash.runtime import int4
from treeflash.train.dflash import Sequence, target_view
from treeflash.train.eagle3 import eagle3_loss, ttt_states

from conftest import tiny_target
from test_cli import tiny_folder  # noqa: F401  (fixture)
from test_lossless import repetitive_prompt
from test_train import write_store

ATOL = 1e-5  # fp32: the tree's batched, masked attention against the one-path reference


def tiny_eagle3(target, seed: int = 0, draft_vocab: int = 48) -> Eagle3Drafter:
    """A tiny random EAGLE-3 drafter scoring a random half of the tiny target's vocabulary."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(Eagle3Config.for_target(target.config, draft_vocab))
    ids = torch.randperm(target.config.vocab_size)[:draft_vocab]
    return model.use_vocab(ids, target.model.get_output_embeddings().weight).attach(target.model).eval()


def path_probs(model: Eagle3Drafter, tokens: list[int], feats: torch.Tensor, path: list[int]) -> list[float]:
    """The reference: the drafter's probability of each token of `path` given the ones before it, after the
    context (`tokens`, its last one the root; `feats` the taps of every position but the root's), running the
    layer causally over the context and then one path entry at a time."""
    C, layer = len(feats), model.midlayer
    state = model.fuse(feats)
    q, k, v = layer.qkv(model.embed(torch.tensor(tokens[1:C + 1])), state, torch.arange(C))
    causal = torch.arange(C)[None, :] <= torch.arange(C)[:, None]
    prev = layer.finish(state, attend(q, k, v, causal))[-1]
    draft_id = {int(t): i for i, t in enumerate(model.vocab_ids)}
    probs = []
    for d, token in enumerate(path, start=1):
        probs.append(float(torch.softmax(model.scores(prev).float(), -1)[draft_id[token]]))
        q, k1, v1 = layer.qkv(model.embed(torch.tensor([token])), prev[None], torch.tensor([C - 1 + d]))
        k, v = torch.cat([k, k1]), torch.cat([v, v1])
        prev = layer.finish(prev[None], attend(q, k, v, None))[0]
    return probs


def test_the_dynamic_tree_is_the_sequential_drafter_on_every_path():
    target = tiny_target("llama")
    model = tiny_eagle3(target)
    rng = random.Random(0)
    tokens = [rng.randrange(96) for _ in range(21)]
    feats = torch.randn(20, 3, 64)
    with torch.no_grad():
        for budget in (1, 5, 24):
            drafter = Eagle3Decoder(model, top_k=4, depth=4)
            tree = drafter.propose(tokens, feats, budget)
            assert 0 < tree.size <= budget and max(tree.depths) <= min(4, budget)
            for node in range(1, len(tree)):
                path = [tree.tokens[i] for i in tree.path_to(node)[1:]]
                assert tree.probs[node] == pytest.approx(path_probs(model, tokens, feats, path)[-1], abs=ATOL)
            scores = [sum(torch.tensor(tree.probs)[tree.path_to(n)[1:]].log().tolist()) for n in range(1, len(tree))]
            assert scores == sorted(scores, reverse=True)  # best first: each prefix is a smaller budget's tree


def test_the_context_catches_up_in_pieces_as_at_once():
    target = tiny_target("qwen3")
    model = tiny_eagle3(target, seed=1)
    tokens = random.Random(1).choices(range(96), k=31)
    feats = torch.randn(30, 3, 64)
    whole, pieces = Eagle3Decoder(model), Eagle3Decoder(model, capacity=4)  # its buffers grow twice
    with torch.no_grad():
        whole.observe(tokens, feats)
        for a, b in ((0, 7), (7, 8), (8, 30)):
            pieces.observe(tokens, feats[a:b])
    torch.testing.assert_close(pieces.k, whole.k, atol=ATOL, rtol=0)
    torch.testing.assert_close(pieces.state, whole.state, atol=ATOL, rtol=0)


def test_training_time_test_is_the_drafter_run_on_the_true_tokens():
    """Step j at position t sees what a depth-(j + 1) node on the true path sees at inference: its logits are the
    reference's for the true tokens after the context up to t + 1."""
    target = tiny_target("llama")
    model = tiny_eagle3(target, seed=2, draft_vocab=96)  # every token (in a shuffled draft order)
    tokens = torch.tensor(random.Random(2).choices(range(96), k=12))
    taps = torch.randn(12, 3, 64)
    with torch.no_grad():
        states = ttt_states(model, tokens, taps, steps=4)
        assert [len(s) for s in states] == [11, 10, 9, 8]
        draft_id = {int(t): i for i, t in enumerate(model.vocab_ids)}
        for t in (0, 3, 6):
            for j in range(4):
                path = tokens[t + 2:t + 3 + j].tolist()  # x_{t+2} .. x_{t+2+j}
                ref = path_probs(model, tokens[:t + 2].tolist(), taps[:t + 1], path)[-1]
                p = torch.softmax(model.scores(states[j][t]).float(), -1)[draft_id[path[-1]]]
                assert float(p) == pytest.approx(ref, abs=ATOL)


def test_a_few_steps_learn():
    target = tiny_target("llama", logit_scale=4.0)
    model = tiny_eagle3(target, draft_vocab=96)
    tokens = torch.tensor(random.Random(3).choices(range(96), k=40))
    view = target_view(target.model, tokens, model.config.target_layer_ids, model.vocab_ids)
    seq = Sequence(tokens, prompt_len=10)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, stats = eagle3_loss(model, seq, view, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0] and 0 <= float(stats["acc_k1"]) <= 1


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_eagle3_gives_the_targets_tokens(kind):
    target = tiny_target(kind, logit_scale=4.0)
    model = tiny_eagle3(target, seed=4)
    prompt = repetitive_prompt(random.Random(4), 96)
    ar = generate(target, make_drafter("ar"), prompt, 40).tokens
    for budget in (1, 3, 16, "auto"):
        assert generate(target, Eagle3Decoder(model), prompt, 40, budget=budget).tokens == ar
    # buffers that grow while a tree's K/V are written after the context
    assert generate(target, Eagle3Decoder(model, capacity=97), prompt, 40, budget=16).tokens == ar
    # its linears 4-bit (what loading does where the target's are): other drafts, the same tokens
    assert int4.quantise_linears(model, torch.float32, keep_weight=True) == 9
    assert generate(target, Eagle3Decoder(model), prompt, 40, budget=16).tokens == ar


def test_the_specforge_layout_round_trips(tmp_path):
    target = tiny_target("llama")
    model = tiny_eagle3(target)
    model.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == eagle3_taps(3) == [1, 0, 0]
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 48
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # [embedding ; state]
    loaded = Eagle3Drafter.from_pretrained(tmp_path).attach(target.model)
    assert torch.equal(loaded.vocab_ids, model.vocab_ids)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_specforge_folder_without_taps_loads_with_the_engines_default_taps(tmp_path):
    """SpecForge's config names no taps (SGLang and vLLM then take layers 1, L / 2 - 1, L - 4) and may carry the
    target's embedding beside the drafter; both load."""
    from safetensors.torch import save_file

    target = tiny_target("llama", num_hidden_layers=8)
    model = tiny_eagle3(target)
    model.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({**state, "embed_tokens.weight": torch.zeros(96, 64)}, str(tmp_path / "model.safetensors"))
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.config.target_layer_ids is None
    assert loaded.attach(target.model).config.target_layer_ids == [1, 3, 4] == eagle3_taps(8)
    assert Eagle3Decoder(loaded).taps == (1, 3, 4)


def test_export_writes_the_layout_and_the_serving_commands(tmp_path, tiny_folder):  # noqa: F811
    target = tiny_target("llama")
    tiny_eagle3(target).save_pretrained(tmp_path / "mine")
    assert main(["export", str(tmp_path / "mine"), "--to", str(tmp_path / "out"), "--target", tiny_folder]) == 0
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.vocab_ids, Eagle3Drafter.from_pretrained(tmp_path / "mine").vocab_ids)
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in readme and '"method": "eagle3"' in readme


def test_train_and_generate_from_the_command_line(tmp_path, tiny_folder, capsys):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    out = tmp_path / "run"
    assert main(["train", "eagle3", "--target", tiny_folder, "--data", str(tmp_path / "regen"), "--out", str(out),
                 "--data-dir", str(tmp_path / "data"), "--steps", "2", "--batch-size", "2", "--draft-vocab", "24",
                 "--ttt-steps", "3", "--save-every", "2", "--log-every", "1", "--target-dtype", "float32"]) == 0
    drafter = out / "drafter"
    assert json.loads((drafter / "config.json").read_text())["draft_vocab_size"] == 24
    capsys.readouterr()
    assert main(["generate", "What is 2 times 2?", "--target", tiny_folder, "--method", "eagle3", "--drafter",
                 str(drafter), "--dtype", "float32", "--max-new-tokens", "8", "--budget", "4"]) == 0
    assert main(["generate", "hi", "--target", tiny_folder, "--method", "eagle3", "--dtype", "float32"]) == 2
    assert "no EAGLE-3 drafter ships" in capsys.readouterr().err


@pytest.mark.parametrize("rows, keys", [(1, 40), (3, 57), (8, 300)])
def test_the_rounds_attention_is_sdpas(rows, keys):
    """`attend_rows` (grouped-query heads as product rows, fp32) against SDPA's `attend`, under a random mask that
    leaves every row a key."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 6, 16, generator=g)
    k, v = torch.randn(2, keys, 2, 16, generator=g)
    mask = torch.rand(rows, keys, generator=g) > 0.3
    mask[:, 0] = True
    torch.testing.assert_close(attend_rows(q, k, v, mask), attend(q, k, v, mask), atol=ATOL, rtol=0)
