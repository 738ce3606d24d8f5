"""Training: losses, the block mask, that a few steps learn, exact resume, a 2-process torchrun run, regen."""

import json
import subprocess
import sys

import pytest
import torch

from treeflash.cli import main
from treeflash.models.checkpoint import DrafterError
from treeflash.models.dflash import DFlashDrafter
from treeflash.eval.datasets import DOMAINS, DatasetError
from treeflash.train.store import Answer, AnswerStore, load_answers, repeat_answers, select_sources
from treeflash.models.blocks import block_mask
from treeflash.train.dflash import (Sequence, block_lengths, dflash_loss, drafted_positions, sample_anchors,
                                    target_view)
from treeflash.train.losses import cosine_lr, forward_kl, position_weights

from conftest import tiny_target
from test_cli import tiny_folder  # noqa: F401  (fixture)
from test_dflash import tiny_drafter


def test_forward_kl():
    p = torch.log_softmax(torch.randn(3, 10), -1)
    q = torch.randn(3, 10)
    manual = (p.exp() * (p - torch.log_softmax(q, -1))).sum(-1)
    torch.testing.assert_close(forward_kl(p, q), manual)
    torch.testing.assert_close(forward_kl(p, q, topk=10), manual, atol=1e-5, rtol=0)
    assert (forward_kl(p, q, topk=3) >= -1e-6).all()
    assert forward_kl(p, p.clone()).abs().max() < 1e-6


def test_schedule_and_weights():
    w = position_weights(16)
    assert w[0] == 1 and len(w) == 15 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0)))
    lrs = [cosine_lr(s, 100, 1.0) for s in range(100)]
    assert lrs[0] < lrs[3] == max(lrs) and lrs[-1] < 0.01


def test_block_mask():
    mask = block_mask(torch.tensor([2, 5]), context=7, block_size=3)
    assert mask.shape == (6, 13)
    assert mask[0, :7].tolist() == [True, True, False, False, False, False, False]  # context before anchor 2
    assert mask[3, :7].tolist() == [True] * 5 + [False] * 2
    assert mask[0, 7:].tolist() == [True] * 3 + [False] * 3  # own block, never the other
    assert mask[4, 7:].tolist() == [False] * 3 + [True] * 3


def test_block_mask_of_short_blocks():
    mask = block_mask(torch.tensor([2, 5]), context=7, block_size=3, lengths=torch.tensor([2, 3]))
    assert mask[0, 7:].tolist() == [True, True, False, False, False, False]  # block 0 is its first 2 positions
    assert mask[2, 7:].tolist() == [True, True, False, False, False, False]  # also for the position cut off
    assert mask[4, 7:].tolist() == [False] * 3 + [True] * 3


def test_block_lengths():
    gen = torch.Generator().manual_seed(0)
    assert block_lengths(10, 16, 0.0, gen) is None
    lengths = block_lengths(4000, 16, 0.5, gen)
    cut = lengths[lengths < 16]
    assert int(cut.min()) == 2 and int(cut.max()) == 15
    assert abs(len(cut) / len(lengths) - 0.5) < 0.03


def test_anchors_stay_in_the_answer():
    seq = Sequence(torch.arange(30), prompt_len=10)
    anchors = sample_anchors(seq, 50, torch.Generator().manual_seed(0))
    assert anchors.tolist() == list(range(10, 29))


def test_a_few_steps_learn():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    seq = Sequence(torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)), prompt_len=5)
    view = target_view(target.model, seq.tokens, drafter.config.target_layer_ids)
    anchors = sample_anchors(seq, 16, torch.Generator().manual_seed(0))
    optim = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, stats = dflash_loss(drafter, seq, view, anchors)
        optim.zero_grad()
        loss.backward()
        optim.step()
        first = first or float(stats["loss"])
    assert float(stats["loss"]) < 0.5 * first


BLOCK_ATTENTION_TOL = dict(atol=1e-5, rtol=1e-5)  # fp32: the same sums in another order


def test_blocks_over_context_equals_the_flat_reference():
    """Training's attention (each block over the context before its anchor and over itself, the context's K/V
    shared by all blocks) gives the states of the plain layout: the N blocks flattened after the context, one SDPA
    under `block_mask`."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4, seed=3)
    g, S = 4, 23
    tokens = torch.randint(0, 96, (S,), generator=torch.Generator().manual_seed(1))
    taps = torch.randn(S, len(drafter.config.target_layer_ids), 64)
    anchors = torch.tensor([3, 4, 9, 15, 21])
    with torch.no_grad():
        fast = drafter(anchors, tokens, taps)
        ctx_kv = drafter.context_kv(drafter.fuse(taps), torch.arange(S))
        positions = (anchors[:, None] + torch.arange(g)).flatten()
        flat = drafter.hidden(drafter.block_inputs(tokens[anchors]), positions, ctx_kv, block_mask(anchors, S, g))
    torch.testing.assert_close(fast, flat.unflatten(0, (len(anchors), g))[:, 1:], **BLOCK_ATTENTION_TOL)
    lengths = torch.tensor([4, 2, 3, 4, 2])  # short blocks: each sees its first lengths[n] positions only
    with torch.no_grad():
        fast = drafter(anchors, tokens, taps, lengths=lengths)
        flat = drafter.hidden(drafter.block_inputs(tokens[anchors]), positions, ctx_kv,
                              block_mask(anchors, S, g, lengths))
    torch.testing.assert_close(fast, flat.unflatten(0, (len(anchors), g))[:, 1:], **BLOCK_ATTENTION_TOL)


def test_a_short_block_in_training_is_the_block_drafted_at_inference():
    """A drafter trained for short blocks drafts a tree `depth` deep from a block of depth + 1 positions: the
    states training computed for a block of that length (the positions after it masked)."""
    from treeflash.models.dflash import ContextCache

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=6, seed=4).eval()
    drafter.config.short_blocks = True
    S, anchor = 17, 11
    tokens = torch.randint(0, 96, (S,), generator=torch.Generator().manual_seed(2))
    taps = torch.randn(S, len(drafter.config.target_layer_ids), 64)
    with torch.no_grad():
        fused, k, v = drafter.context_states(taps[:anchor], torch.arange(anchor))
        cache = ContextCache(drafter)
        cache.append(k, v)
        for depth in (1, 3, 5):
            trained = drafter(torch.tensor([anchor]), tokens, taps, lengths=torch.tensor([depth + 1]))[0, :depth]
            drafted = drafter.draft_states(int(tokens[anchor]), anchor, cache, depth)
            torch.testing.assert_close(drafted, trained, **BLOCK_ATTENTION_TOL)
        whole = drafter.draft_states(int(tokens[anchor]), anchor, cache, 2)  # a long block gives other states
        drafter.config.short_blocks = False
        assert not torch.allclose(whole, drafter.draft_states(int(tokens[anchor]), anchor, cache, 2))


def test_the_draft_vocabulary_loss():
    """Over a draft vocabulary V' the loss is m * KL(p' || q), p' the target's distribution restricted to V' and
    renormalised, m its mass there; over the whole vocabulary, the plain forward KL."""
    from treeflash.train.losses import forward_kl

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4, seed=2)
    seq = Sequence(torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(0)), prompt_len=6)
    anchors = torch.tensor([6, 10, 17])
    whole = target_view(target.model, seq.tokens, drafter.config.target_layer_ids)
    predicted = drafted_positions(anchors, 4)
    valid = predicted < 20
    weights = position_weights(4)[None].expand_as(predicted)[valid]
    with torch.no_grad():
        h = drafter(anchors, seq.tokens, whole.taps)[valid]
        loss, stats = dflash_loss(drafter, seq, whole, anchors)
        plain = forward_kl(whole.logp[predicted[valid] - 1], drafter.logits(h))
        torch.testing.assert_close(loss, (weights * plain).sum() / weights.sum())
        assert float(stats["outside"]) == pytest.approx(0, abs=1e-6)
        steep = position_weights(4, decay=0.5)[None].expand_as(predicted)[valid]  # the first positions weigh more
        loss, _ = dflash_loss(drafter, seq, whole, anchors, decay=0.5)
        torch.testing.assert_close(loss, (steep * plain).sum() / steep.sum())

        vocab = torch.tensor([0, 3, 5, 16, 40, 41, 77])
        drafter.use_draft_vocab(vocab)
        view = target_view(target.model, seq.tokens, drafter.config.target_layer_ids, vocab)
        assert view.logp.shape == (20, 7) and torch.equal(view.argmax, whole.argmax)
        loss, stats = dflash_loss(drafter, seq, view, anchors)
        p = whole.logp[predicted[valid] - 1].exp()[:, vocab]
        m = p.sum(-1)
        q = torch.softmax(drafter.scores(h).float(), -1)
        by_hand = m * (p / m[:, None] * ((p / m[:, None]).log() - q.log())).sum(-1)
        torch.testing.assert_close(loss, (weights * by_hand).sum() / weights.sum())
        assert float(stats["outside"]) == pytest.approx(float(1 - m.mean()), abs=1e-6)


def test_training_saves_the_draft_vocabulary_it_trained_on(tmp_path, tiny_folder):  # noqa: F811
    from treeflash.models.dflash_io import RANKING_FILE

    write_store(tmp_path, tiny_folder)
    out = tmp_path / "run"
    assert main(train_args(tmp_path, tiny_folder, out, 1) + ["--draft-vocab", "24"]) == 0
    config = json.loads((out / "drafter" / "config.json").read_text())
    ranking = json.loads((out / "drafter" / RANKING_FILE).read_text())["ranking"]
    assert config["draft_vocab_size"] == 24 and len(ranking) > 24
    drafter = DFlashDrafter.from_pretrained(out / "drafter")
    from treeflash.models.dflash_io import draft_vocab

    assert draft_vocab(drafter, out / "drafter").tolist() == ranking[:24]
    again = tmp_path / "again"  # going on from it keeps its vocabulary
    assert main(train_args(tmp_path, tiny_folder, again, 1) + ["--init", str(out / "drafter")]) == 0
    assert json.loads((again / "drafter" / "config.json").read_text())["draft_vocab_size"] == 24
    assert json.loads((again / "drafter" / RANKING_FILE).read_text())["ranking"] == ranking
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "all", 1) + ["--draft-vocab", "0"]) == 0
    assert json.loads((tmp_path / "all" / "drafter" / "config.json").read_text())["draft_vocab_size"] is None


def write_store(tmp_path, target_folder, n=6, length=40):
    """A prompt set (gsm8k/train.jsonl under tmp_path/data) and an answer store (tmp_path/regen) of random answers
    to it, as `data regen` would write them for the target in `target_folder`."""
    from treeflash.runtime import Target

    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True, exist_ok=True)
    questions = [f"What is {i} times {i}?" for i in range(n)]
    (data / "gsm8k" / "train.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    encode = Target.load(target_folder, dtype="float32").encode_prompt
    g = torch.Generator().manual_seed(0)
    answers = [torch.randint(0, 90, (length,), generator=g).tolist() for _ in range(n)]
    AnswerStore(tmp_path / "regen").append([f"gsm8k/{i}" for i in range(n)], [encode(q) for q in questions], answers,
                                           STORE_META)
    return tmp_path / "regen"


STORE_META = {"target": "tiny", "dtype": "float32", "temperature": 0.0, "seed": 0, "max_new_tokens": 40,
              "commit": None, "command": "test"}


def train_args(tmp_path, target, out, steps):
    return ["train", "dflash", "--target", target, "--data", str(tmp_path / "regen"), "--out", str(out),
            "--data-dir", str(tmp_path / "data"), "--steps", str(steps), "--batch-size", "2", "--layers", "1",
            "--taps", "2", "--block-size", "4", "--num-anchors", "4", "--save-every", "2", "--log-every", "1",
            "--target-dtype", "float32"]


def test_a_drafter_trained_for_short_blocks_says_so_and_goes_on_so(tmp_path, tiny_folder, capsys):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    out, again = tmp_path / "run", tmp_path / "again"
    assert main(train_args(tmp_path, tiny_folder, out, 1) + ["--short-blocks", "0.5"]) == 0
    assert json.loads((out / "drafter" / "config.json").read_text())["short_blocks"] is True
    assert main(train_args(tmp_path, tiny_folder, again, 1) + ["--init", str(out / "drafter")]) == 0
    assert json.loads((again / "train_args.json").read_text())["short_blocks"] is None  # its default: 0.5
    assert DFlashDrafter.from_pretrained(again / "drafter").config.short_blocks
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "bad", 1) + ["--short-blocks", "1"]) != 0
    assert "--short-blocks 1.0: a share of the blocks" in capsys.readouterr().err


def test_resume_is_exact(tmp_path, tiny_folder):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "straight", 4)) == 0
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "resumed", 2)) == 0
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "resumed", 4)) == 0  # picks up at step 2
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=0, rtol=0)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "resumed" / "log.jsonl")]
    assert steps == [1, 2, 3, 4]


def test_trained_drafters_use_a_mask_token(tmp_path, tiny_folder):  # noqa: F811
    """`train dflash` writes the published format: dflash_config.mask_token_id, no mask embedding tensor."""
    from safetensors.torch import load_file

    write_store(tmp_path, tiny_folder)
    for choice, expected in ((None, 16), ("<file_sep>", 5), ("9", 9)):  # the default, a token's text, an id
        out = tmp_path / f"run-{expected}"
        args = train_args(tmp_path, tiny_folder, out, 1) + (["--mask-token", choice] if choice else [])
        assert main(args) == 0
        config = json.loads((out / "drafter" / "config.json").read_text())
        assert config["dflash_config"]["mask_token_id"] == expected
        assert not any("mask" in k for k in load_file(str(out / "drafter" / "model.safetensors")))
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "bad", 1) + ["--mask-token", "no such token"]) == 2


def test_resume_refuses_another_models_checkpoint(tmp_path, tiny_folder, capsys):  # noqa: F811
    """A run folder of another model shape is an error, never a silent partial load."""
    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "run", 2)) == 0
    wider = train_args(tmp_path, tiny_folder, tmp_path / "run", 4)
    wider[wider.index("--layers") + 1] = "2"
    assert main(wider) == 2
    assert "do not match the model: missing ['layers.1." in capsys.readouterr().err


def test_torchrun_two_processes(tmp_path, tiny_folder):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "treeflash.cli", *train_args(tmp_path, tiny_folder, out, 2)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "train_args.json").read_text())["world_size"] == 2
    assert (out / "drafter" / "model.safetensors").exists()
    assert len(open(out / "log.jsonl").readlines()) == 2


def _gsm8k_prompts(tmp_path, n):
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True, exist_ok=True)
    (data / "gsm8k" / "train.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n"
                                                        for i in range(n)))
    return data


def test_regen_appends_to_a_store_and_resumes_from_it(tmp_path, tiny_folder):  # noqa: F811
    from treeflash.train.data import source_commit

    data = _gsm8k_prompts(tmp_path, 5)
    args = ["data", "regen", "--target", tiny_folder, "--data-dir", str(data), "--sources", "gsm8k",
            "--out", str(tmp_path / "regen"), "--batch-size", "2", "--shard-size", "2", "--max-new-tokens", "5",
            "--dtype", "float32"]
    assert main(args) == 0
    store = AnswerStore(tmp_path / "regen")
    entries = store.entries()
    assert [e["answers"] for e in entries] == [2, 2, 1]  # shards of 2
    answers = list(store.answers())
    assert sorted(a.id for a in answers) == [f"gsm8k/{i}" for i in range(5)]
    assert all(1 <= len(a.response_ids) <= 5 and a.temperature == 0.0 for a in answers)
    assert all(e["commit"] == source_commit() and e["target"] == tiny_folder and e["seed"] == 0 for e in entries)
    assert entries[0]["command"].startswith("treeflash data regen --target")
    assert main(args) == 0  # nothing left to do: no new shard
    assert len(store.entries()) == 3 and store.verify() == []
    out = tmp_path / "manifest.json"
    assert main(["data", "manifest", str(tmp_path / "regen"), "--out", str(out)]) == 0
    held = json.loads(out.read_text())[0]
    assert held["answers"] == 5 and held["by_source"] == {"gsm8k T=0": {"answers": 5}}
    assert held["tokens"] == sum(len(a.response_ids) for a in answers) and len(held["runs"]) == 1
    assert main(["data", "check", str(tmp_path / "regen")]) == 0
    # training reads the prompts back by id and encodes them: the ids the answers were made for
    from treeflash.runtime import Target

    target = Target.load(tiny_folder, dtype="float32")
    rows = load_answers(tmp_path / "regen", target.encode_prompt, data)
    assert [r["prompt_ids"] for r in rows] == [target.encode_prompt(f"What is {i} + {i}?") for i in range(5)]


def test_the_store_finds_what_is_wrong_with_it(tmp_path, tiny_folder, capsys):  # noqa: F811
    """Changed, missing and stray shards; a prompt that no longer encodes to its answer's ids; another target."""
    from treeflash.eval.datasets import DatasetError
    from treeflash.runtime import Target

    folder = write_store(tmp_path, tiny_folder)
    store = AnswerStore(folder)
    encode = Target.load(tiny_folder, dtype="float32").encode_prompt
    with pytest.raises(DatasetError, match="holds answers of target 'tiny'"):
        store.append(["gsm8k/9"], [[1]], [[2]], {**STORE_META, "target": "another"})
    (data := tmp_path / "data" / "gsm8k" / "train.jsonl").write_text(data.read_text().replace("What", "Who"))
    with pytest.raises(DatasetError, match="6 prompts encode to other ids"):
        load_answers(folder, encode, tmp_path / "data")
    (folder / "stray.npz").write_bytes(b"x")
    shard = folder / store.entries()[0]["shard"]
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")
    assert store.verify() == ["shard-00000.npz: sha256 differs from the manifest's", "stray.npz: not in the manifest"]
    assert main(["data", "check", str(folder)]) == 1
    assert "sha256 differs" in capsys.readouterr().err
    shard.unlink()
    assert store.verify()[0] == "shard-00000.npz: missing"


def test_sources_keep_whole_sources_and_the_first_n_of_capped_ones():
    answers = [Answer(f"{s}/{i}", [1], t, 0) for t in (0.0, 1.0) for s in ("gsm8k", "sharegpt", "mbpp")
               for i in range(4)]
    kept = select_sources(answers, "sharegpt, gsm8k:3")
    assert [a.id for a in kept if a.id.startswith("sharegpt")] == [f"sharegpt/{i}" for i in range(4)] * 2
    assert [(a.id, a.temperature) for a in kept if a.id.startswith("gsm8k")] == [(f"gsm8k/{i}", 0.0) for i in range(3)]
    assert not any(a.id.startswith("mbpp") for a in kept)
    assert select_sources(answers, None) == answers
    with pytest.raises(DatasetError, match="--sources: the answers hold none of code_alpaca"):
        select_sources(answers, "code_alpaca")
    with pytest.raises(DatasetError, match="positive count"):
        select_sources(answers, "gsm8k:0")


def test_repeat_weights_a_source_or_its_answers_at_one_temperature():
    answers = [Answer(f"{s}/{i}", [1], t, 0) for t in (0.0, 1.0) for s in ("gsm8k", "sharegpt") for i in range(2)]
    count = lambda kept, source, t: sum(a.source == source and a.temperature == t for a in kept)  # noqa: E731
    kept = repeat_answers(answers, "sharegpt@0=3, gsm8k=2")
    assert [count(kept, s, t) for s in ("sharegpt", "gsm8k") for t in (0.0, 1.0)] == [6, 2, 4, 4]
    assert repeat_answers(answers, "sharegpt@1.0=2,sharegpt=5") == [a for a in answers for _ in range(
        2 if (a.source, a.temperature) == ("sharegpt", 1.0) else 5 if a.source == "sharegpt" else 1)]
    assert repeat_answers(answers, None) == answers
    for bad in ("sharegpt=0", "sharegpt", "sharegpt@x=2", "sharegpt=two"):
        with pytest.raises(DatasetError, match="SOURCE=N"):
            repeat_answers(answers, bad)
    with pytest.raises(DatasetError, match="--repeat: the answers hold none of mbpp"):
        repeat_answers(answers, "mbpp=2")


def test_old_jsonl_folders_import_into_a_store(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    rows = [{"id": f"gsm8k/{i}", "prompt_ids": [1, i], "response_ids": [3] * (i + 1), "temperature": 0.0}
            for i in range(5)]
    (old / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (old / "runs.jsonl").write_text(json.dumps({"event": "started", "commit": "abc", "target": "t", "dtype": "bfloat16",
                                                "seed": 0, "max_new_tokens": 8, "batch_size": 2}) + "\n")
    assert main(["data", "import", str(old), "--into", str(tmp_path / "store"), ]) == 0
    assert main(["data", "import", str(old), "--into", str(tmp_path / "store"), ]) == 0  # nothing twice
    store = AnswerStore(tmp_path / "store")
    assert [(a.id, a.response_ids) for a in store.answers()] == [(r["id"], r["response_ids"]) for r in rows]
    assert store.entries()[0]["command"] == "treeflash data regen --target t --dtype bfloat16 --seed 0 " \
        "--max-new-tokens 8 --batch-size 2" and store.verify() == []


def test_the_repository_store_matches_its_manifest():
    """data/answers, the answers the shipped drafters train on: every shard as its manifest line records it."""
    from pathlib import Path

    from treeflash.train.data import SOURCES
    from treeflash.train.magpie import SOURCE as MAGPIE

    store = AnswerStore(Path(__file__).parent.parent / "data" / "answers")
    assert store.entries(), "the repository's answer store is empty"
    assert store.verify() == []
    assert {i.split("/")[0] for e in store.entries() for i in e["ids"]} <= {*SOURCES, MAGPIE}


def test_the_chat_dev_set_is_held_out(tmp_path, monkeypatch):
    """A fixed 5 % of the ShareGPT prompts, by a seeded hash of their ids: never regenerated, never trained on
    (even from stores written before the split), and what `--dataset chat-dev` reads."""
    from treeflash.eval.datasets import is_chat_dev, load_prompts
    from treeflash.train.data import training_prompts

    dev = [i for i in range(2000) if is_chat_dev(f"sharegpt/{i}")]
    assert 80 <= len(dev) <= 120 and dev == [i for i in range(2000) if is_chat_dev(f"sharegpt/{i}")]
    assert not any(is_chat_dev(f"gsm8k/{i}") for i in range(200))
    data = tmp_path / "data"
    (data / "prompts").mkdir(parents=True)
    (data / "prompts" / "sharegpt_prompts.jsonl").write_text("".join(json.dumps({"prompt": f"chat {i}"}) + "\n"
                                                                     for i in range(200)))
    monkeypatch.setenv("TREEFLASH_DATA", str(data))
    held_out = load_prompts("chat-dev")
    assert held_out == [f"chat {i}" for i in dev if i < 200] and held_out
    trained = training_prompts(data, ["sharegpt"])
    assert len(trained) + len(held_out) == 200 and not set(p for _, p in trained) & set(held_out)
    store = AnswerStore(tmp_path / "old")
    store.append([f"sharegpt/{i}" for i in range(200)], [[1]] * 200, [[2]] * 200, STORE_META)
    assert {a.id for a in store.answers()} == {i for i, _ in trained}
    assert store.summary()["answers"] == len(trained)


def test_regen_samples_at_a_temperature_and_training_reads_both(tmp_path, tiny_folder):  # noqa: F811
    from treeflash.runtime import Target

    data = _gsm8k_prompts(tmp_path, 4)
    encode = Target.load(tiny_folder, dtype="float32").encode_prompt

    def regen(out, *extra):
        assert main(["data", "regen", "--target", tiny_folder, "--data-dir", str(data), "--sources", "gsm8k",
                     "--out", str(out), "--batch-size", "4", "--max-new-tokens", "8", "--dtype", "float32",
                     *extra]) == 0
        return load_answers(out, encode, data)

    greedy = {r["id"]: r for r in regen(tmp_path / "store")}
    both = regen(tmp_path / "store", "--temperature", "1", "--seed", "3")  # appended to the same store
    assert len(both) == 8 and [r["temperature"] for r in both] == [0.0] * 4 + [1.0] * 4
    sampled = {r["id"]: r for r in both[4:]}
    assert any(sampled[i]["response_ids"] != greedy[i]["response_ids"] for i in greedy)  # a random tiny model
    assert regen(tmp_path / "again", "--temperature", "1", "--seed", "3") == both[4:]  # seeded: reproducible
    assert len(regen(tmp_path / "store", "--temperature", "1", "--seed", "3")) == 8  # resumed: nothing new


def test_continuous_regen_gives_the_padded_hf_batches_answers(tmp_path, tiny_folder, monkeypatch):  # noqa: F811
    """The fast path (continuous batching on the static runtime) against its reference (HF `generate` on left-padded
    batches): the same greedy answers in fp32; and a resumed sampling run draws what a whole one does."""
    from treeflash.runtime import Target
    from treeflash.train.data import answer_continuously, answer_in_batches, regenerate

    target = Target.load(tiny_folder, dtype="float32")
    assert target.static is not None  # else regenerate would take the reference path
    prompts = [(f"gsm8k/{i}", target.encode_prompt("What is 1 + 2?" * (1 + i % 4))) for i in range(7)]
    fast = {r["id"]: r for rows in answer_continuously(target, prompts, 12, 3, 0, 0.0) for r in rows}
    slow = {r["id"]: r for rows in answer_in_batches(target, prompts, 12, 3, 0, 0.0) for r in rows}
    assert fast == slow and len(fast) == 7

    texts = [(i, f"Tell me about {i}.") for i in "abcdef"]
    whole, resumed = AnswerStore(tmp_path / "whole"), AnswerStore(tmp_path / "resumed")
    regenerate(target, texts, whole, STORE_META, 10, 4, seed=5, temperature=1.0)
    regenerate(target, texts[:2], resumed, STORE_META, 10, 4, seed=5, temperature=1.0)  # interrupted ...
    regenerate(target, texts, resumed, STORE_META, 10, 4, seed=5, temperature=1.0)  # ... and resumed
    assert sorted((a.id, a.response_ids) for a in whole.answers()) == \
        sorted((a.id, a.response_ids) for a in resumed.answers())

    # Two processes sharing a store, the second starting after the first wrote its share (the race CI once hit):
    # every prompt answered once, as one process answers them.
    shared = AnswerStore(tmp_path / "shared")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        regenerate(target, texts, shared, STORE_META, 10, 2, seed=5, temperature=1.0, shard_size=1)
    assert sorted((a.id, a.response_ids) for a in shared.answers()) == \
        sorted((a.id, a.response_ids) for a in whole.answers())


def test_regen_refuses_a_missing_prompt_set(tmp_path, capsys):
    assert main(["data", "regen", "--data-dir", str(tmp_path), "--sources", "gsm8k"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_treeflash_training_on_a_frozen_backbone(tmp_path, tiny_folder):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "backbone", 2)) == 0
    backbone = tmp_path / "backbone" / "drafter"
    args = ["train", "treeflash", "--backbone", str(backbone), "--freeze-backbone", "--target", tiny_folder,
            "--data", str(tmp_path / "regen"), "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "tf"),
            "--steps", "3", "--batch-size", "2", "--num-anchors", "4", "--lr", "1e-2", "--target-dtype", "float32"]
    assert main(args) == 0

    before, after = DFlashDrafter.from_pretrained(backbone), DFlashDrafter.from_pretrained(tmp_path / "tf" / "drafter")
    assert after.ar_layer is not None and after.ar_layer.d.weight.abs().sum() > 0
    for (name, a), b in zip(before.state_dict().items(), (after.state_dict()[k] for k in before.state_dict())):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"frozen backbone changed: {name}")
    # the frozen run saves only the AR layer, pointing to its backbone, and refuses a backbone that changed
    from safetensors.torch import load_file

    assert all(k.startswith("ar_layer.") for k in load_file(str(tmp_path / "tf" / "drafter" / "model.safetensors")))
    # a TreeFlash drafter as --backbone: its AR layer trains further, still saved against the DFlash backbone
    more = [*args[:3], str(tmp_path / "tf" / "drafter"), *args[4:]]
    more[more.index("--out") + 1] = str(tmp_path / "tf2")
    assert main(more) == 0
    again = DFlashDrafter.from_pretrained(tmp_path / "tf2" / "drafter")
    assert again.backbone_folder == backbone.resolve()
    assert not torch.equal(again.ar_layer.d.weight, after.ar_layer.d.weight)
    # a new backbone (the old one trained on) starts from the old AR layer with --init: same settings, a small step
    assert main([*train_args(tmp_path, tiny_folder, tmp_path / "backbone2", 1), "--init", str(backbone)]) == 0
    backbone2 = tmp_path / "backbone2" / "drafter"
    moved = [*args[:3], str(backbone2), *args[4:], "--init", str(tmp_path / "tf" / "drafter"), "--ar-kind", "linear"]
    moved[moved.index("--out") + 1], moved[moved.index("--steps") + 1] = str(tmp_path / "tf3"), "1"
    assert main(moved) == 0
    third = DFlashDrafter.from_pretrained(tmp_path / "tf3" / "drafter")
    assert third.backbone_folder == backbone2.resolve() and third.config.ar_layer == after.config.ar_layer
    step = (third.ar_layer.d.weight - after.ar_layer.d.weight).abs().max()
    assert 0 < step < after.ar_layer.d.weight.abs().max()
    moved[moved.index("--init") + 1] = str(backbone)  # not a TreeFlash drafter
    assert main(moved) == 2
    changed = DFlashDrafter.from_pretrained(backbone)
    torch.nn.init.zeros_(changed.fc.weight)
    changed.save_pretrained(backbone)
    with pytest.raises(DrafterError, match="not the one"):
        DFlashDrafter.from_pretrained(tmp_path / "tf" / "drafter")


def test_init_goes_on_training_a_dflash_drafter(tmp_path, tiny_folder):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "first", 2)) == 0
    first = DFlashDrafter.from_pretrained(tmp_path / "first" / "drafter")
    more = train_args(tmp_path, tiny_folder, tmp_path / "more", 1)
    more[more.index("--layers") + 1] = "2"  # ignored: the init's sizes are kept
    assert main([*more, "--init", str(tmp_path / "first" / "drafter")]) == 0
    further = DFlashDrafter.from_pretrained(tmp_path / "more" / "drafter")
    assert further.config.num_hidden_layers == first.config.num_hidden_layers == 1
    a, b = first.state_dict(), further.state_dict()
    step = max((a[k] - b[k]).abs().max() for k in a)
    assert 0 < step < max(v.abs().max() for v in a.values())  # one small step from the init, not a fresh start

    first.add_ar_layer("swiglu", 1)
    first.save_pretrained(tmp_path / "tf", dtype=torch.float32)
    assert main([*more, "--init", str(tmp_path / "tf"), "--out", str(tmp_path / "x")]) == 2  # not a DFlash drafter


def test_a_grown_drafter_drafts_what_it_grew_from_then_trains_its_new_layer(tmp_path, tiny_folder):  # noqa: F811
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    c = drafter.config
    taps, positions = torch.randn(6, len(c.target_layer_ids), c.hidden_size), torch.arange(6)

    def logits(d):
        return d.draft_logits(3, 6, d.context_kv(d.fuse(taps), positions))

    before = logits(drafter)
    grown = drafter.add_layers(2)
    assert grown.config.num_hidden_layers == len(grown.layers) == 4
    assert torch.equal(logits(grown), before)  # each new layer adds exactly zero

    write_store(tmp_path, tiny_folder)
    assert main(train_args(tmp_path, tiny_folder, tmp_path / "first", 1)) == 0
    grow = [*train_args(tmp_path, tiny_folder, tmp_path / "grown", 2), "--init", str(tmp_path / "first" / "drafter")]
    assert main([*grow, "--add-layers", "1"]) == 0
    first = DFlashDrafter.from_pretrained(tmp_path / "first" / "drafter")
    trained = DFlashDrafter.from_pretrained(tmp_path / "grown" / "drafter")
    assert trained.config.num_hidden_layers == first.config.num_hidden_layers + 1
    assert trained.layers[-1].mlp.down_proj.weight.abs().max() > 0  # opened up by training
    assert main([*grow, "--add-layers", "-1"]) == 2
    assert main([*grow, "--loss-decay", "0"]) == 2  # a weight exp(-(k - 1) / D) needs D > 0
    assert main([*train_args(tmp_path, tiny_folder, tmp_path / "fresh", 1), "--add-layers", "1"]) == 2  # no init


def test_draft_layers_can_start_as_the_targets_last_layers():
    from treeflash.train.dflash import init_from_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    assert init_from_target(drafter, target.model) == [len(target.model.model.layers) - 2,
                                                        len(target.model.model.layers) - 1]
    for mine, theirs in zip(drafter.layers, target.model.model.layers[-2:]):
        for k, v in theirs.state_dict().items():
            assert torch.equal(mine.state_dict()[k], v), k
        assert torch.equal(mine.self_attn.q_norm.weight, torch.ones(drafter.config.head_dim))
    taps = torch.randn(5, 2, 64)
    torch.testing.assert_close(drafter.fc(taps.flatten(-2)), taps[:, -1])  # the deepest tap, as it is


def test_a_stage_ships_only_when_it_wins_everywhere(tmp_path):
    """scripts/ship_if_better.py: exit 0 and copy only if every method beats the shipped drafters on every domain;
    a shipped adapter points at the shipped DFlash folder beside it."""
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "ship_if_better.py"

    def report(name, tau):
        (tmp_path / "run" / "eval").mkdir(parents=True, exist_ok=True)
        (tmp_path / "run" / "eval" / name).write_text(json.dumps({"methods": {"ddtree": {"expected_tau": tau}}}))

    for domain in DOMAINS:
        report(f"shipped-{domain}.json", 2.0)
        report(f"new-{domain}.json", 2.1 if domain != "mbpp" else 1.9)
    new, shipped = tmp_path / "new", tmp_path / "ckpt" / "smollm2-135m-instruct-treeflash"
    for folder, backbone in ((new, "../../run/dflash"), (shipped, "../smollm2-135m-instruct-dflash")):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"treeflash_config": {"backbone": backbone}, "v": str(folder)}))
    (shipped / "README.md").write_text("card")

    def ship():
        return subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "ddtree", "1", str(new),
                               str(shipped)], capture_output=True, text=True)

    lost = ship()
    assert lost.returncode == 1 and "| mbpp | 2.000 | 1.900 | 0.950x |" in lost.stdout
    assert json.loads((shipped / "config.json").read_text())["v"] == str(shipped)  # untouched
    report("new-mbpp.json", 2.2)
    won = ship()
    assert won.returncode == 0, won.stdout + won.stderr
    config = json.loads((shipped / "config.json").read_text())
    assert config["v"] == str(new) and config["treeflash_config"]["backbone"] == "../smollm2-135m-instruct-dflash"
    assert (shipped / "README.md").read_text() == "card"


def test_a_stage_is_judged_on_one_report_per_method(tmp_path):
    """ship_if_better merges new-D-METHOD.json reports (each method on its own rounds), and refuses a method that two
    reports of one domain score."""
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "ship_if_better.py"
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()

    def report(name, method, tau):
        (eval_dir / name).write_text(json.dumps({"methods": {f"{method}@16": {"expected_tau": tau}}}))

    for domain in DOMAINS:
        for method, new_tau in (("treeflash", 2.2), ("tfm", 2.3 if domain != "gsm8k" else 1.9)):
            report(f"shipped-{domain}-{method}.json", method, 2.0)
            report(f"new-{domain}-{method}.json", method, new_tau)

    def judge(methods):
        return subprocess.run([sys.executable, str(script), str(tmp_path), methods], capture_output=True, text=True)

    assert judge("treeflash@16").returncode == 0
    lost = judge("treeflash@16,tfm@16")
    assert lost.returncode == 1 and "| gsm8k | 2.000 | 2.200 | 1.100x | 2.000 | 1.900 | 0.950x |" in lost.stdout
    assert "missing" in judge("ddtree@16").stderr
    report("new-gsm8k.json", "tfm", 2.5)  # a second report for tfm on gsm8k
    assert "in two new-gsm8k reports" in judge("tfm@16").stderr


def test_a_stage_is_judged_by_domain(tmp_path):
    """ship_if_better --domains: a domain is won when its cells' geometric mean ratio is above 1 and no cell is
    significantly worse (a bootstrap over the prompts' sums); it needs those sums."""
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "ship_if_better.py"
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    shipped = [15.0, 25.0, 12.0, 30.0, 18.0, 22.0, 16.0, 28.0, 20.0, 14.0]  # per prompt, 10 rounds each

    def report(name, sums: dict):
        methods = {m: {"expected_tau": sum(t) / 100, "prompt_totals": t} for m, t in sums.items()}
        (eval_dir / name).write_text(json.dumps({"prompt_rounds": [10] * 10, "methods": methods}))

    def judge(b_factors):
        for domain in DOMAINS:
            report(f"shipped-{domain}.json", {"a": shipped, "b": shipped})
            report(f"new-{domain}.json", {"a": [t * 1.05 for t in shipped],
                                          "b": [t * f for t, f in zip(shipped, b_factors)]})
        return subprocess.run([sys.executable, str(script), "--domains", str(tmp_path), "a,b"],
                              capture_output=True, text=True)

    noisy = judge([1.03, 0.97] * 5)  # b loses 0.6 % in every domain: within its noise, and a's gain outweighs it
    assert noisy.returncode == 0, noisy.stdout + noisy.stderr
    assert "| gsm8k | 2.000 | 2.100 | 1.050x (1.050-1.050) | 2.000 | 1.989 | 0.994x (" in noisy.stdout
    assert judge([0.98] * 10).returncode == 1  # b 2 % worse on every prompt: significant, though the mean is up
    report("new-mbpp.json", {"a": shipped, "b": shipped})  # no gain on mbpp: its geometric mean is 1
    (eval_dir / "new-mbpp.json").write_text(json.dumps({"methods": {m: {"expected_tau": 2.2} for m in "ab"}}))
    assert "per-prompt sums" in subprocess.run([sys.executable, str(script), "--domains", str(tmp_path), "a,b"],
                                               capture_output=True, text=True).stderr


def test_batch_rule_for_many_processes():
    from treeflash.train.trainer import DEFAULT_BATCH_SIZE, batch_size_for

    assert [batch_size_for(None, w) for w in (1, 2, 3, 8)] == [DEFAULT_BATCH_SIZE, 4, 6, 8]
    assert batch_size_for(16, 8) == 16
    with pytest.raises(ValueError, match="multiple of the 8 processes"):
        batch_size_for(4, 8)
