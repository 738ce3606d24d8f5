"""`treeflash data magpie`: requests the target writes itself, answered greedily, kept with their ids."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from test_cli import tiny_folder  # noqa: F401  (a fixture)
from treeflash.cli import main
from treeflash.runtime import Target
from treeflash.train.magpie import user_turn_template, written_turn
from treeflash.train.store import AnswerStore, load_answers

EOS_BOOST = 30.0  # the EOS row of the tied embedding scaled: a random tiny model then ends turns within a few tokens


def test_a_user_turn_fits_between_the_template_halves(tiny_folder):  # noqa: F811
    target = Target.load(tiny_folder, dtype="float32")
    before, after = user_turn_template(target)
    assert target.tokenizer.decode(before).endswith("<|im_start|>user\n")
    assert target.tokenizer.decode(after) == "<|im_end|>\n<|im_start|>assistant\n"
    text = "What is a tree?"
    assert before + target.tokenizer(text, add_special_tokens=False).input_ids + after == target.encode_prompt(text)


def test_only_finished_requests_without_special_tokens_are_kept():
    eos, special = frozenset({2}), {0, 1, 2}
    assert written_turn([5, 6, 2], eos, special) == [5, 6]
    assert written_turn([5, 6, 7], eos, special) is None  # cut off: no end of turn
    assert written_turn([2], eos, special) is None  # empty
    assert written_turn([5, 1, 6, 2], eos, special) is None  # writes the template itself
    assert written_turn([], eos, special) is None


def eos_prone(tiny_folder, folder):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    eos = model.config.eos_token_id
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= EOS_BOOST
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(folder)
    return str(folder)


def test_magpie_writes_answers_with_their_prompts_and_resumes(tmp_path, tiny_folder):  # noqa: F811
    target_folder = eos_prone(tiny_folder, tmp_path / "target")
    store_folder = tmp_path / "store"
    args = ["data", "magpie", "--target", target_folder, "--count", "24", "--out", str(store_folder),
            "--batch-size", "4", "--shard-size", "8", "--turn-tokens", "12", "--max-new-tokens", "6",
            "--dtype", "float32"]
    assert main(args) == 0
    store = AnswerStore(store_folder)
    answers = list(store.answers())
    assert 0 < len(answers) <= 24 and store.verify() == []
    target = Target.load(target_folder, dtype="float32")
    before, after = user_turn_template(target)
    prompts = [a.prompt_ids for a in answers]
    assert len({tuple(p) for p in prompts}) == len(prompts)  # no request twice
    for a in answers:
        assert a.source == "magpie" and a.id.startswith("magpie/0-") and a.temperature == 0.0
        turn = a.prompt_ids[len(before):len(a.prompt_ids) - len(after)]
        assert a.prompt_ids[:len(before)] == before and a.prompt_ids[-len(after):] == after and turn
        assert not set(turn) & set(target.tokenizer.all_special_ids)
        assert 1 <= len(a.response_ids) <= 6
    entry = store.entries()[0]
    assert entry["turn_temperature"] == 1.0 and entry["turn_tokens"] == 12 and entry["max_new_tokens"] == 6
    # training reads the prompts from the store, no prompt set needed
    rows = load_answers(store_folder, target.encode_prompt, tmp_path / "no-prompt-sets")
    assert {r["id"]: r["prompt_ids"] for r in rows} == {a.id: a.prompt_ids for a in answers}
    # the answers are the target's greedy ones
    reference = target.model.generate(input_ids=torch.tensor([rows[0]["prompt_ids"]]), max_new_tokens=6,
                                      do_sample=False, eos_token_id=sorted(target.eos_ids))
    answer = reference[0, len(rows[0]["prompt_ids"]):].tolist()
    assert rows[0]["response_ids"] == answer[:len(rows[0]["response_ids"])]
    shards = len(store.entries())
    assert main(args) == 0 and len(store.entries()) == shards  # resumed: every id was tried and kept or dropped
    # seeded: another store written by the same command holds the same requests
    again = tmp_path / "again"
    assert main([*args[:args.index("--out") + 1], str(again), *args[args.index("--out") + 2:]]) == 0
    assert sorted((a.id, a.prompt_ids) for a in AnswerStore(again).answers()) == \
        sorted((a.id, a.prompt_ids) for a in answers)
    out = tmp_path / "manifest.json"
    assert main(["data", "manifest", str(store_folder), "--out", str(out)]) == 0
    assert json.loads(out.read_text())[0]["by_source"] == {"magpie T=0": {"answers": len(answers)}}


def test_regen_refuses_magpie_as_a_prompt_set(tmp_path, capsys):
    assert main(["data", "regen", "--data-dir", str(tmp_path), "--sources", "magpie"]) == 2
    assert "treeflash data magpie" in capsys.readouterr().err
