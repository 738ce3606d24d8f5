"""The command line: JSON shape of bench, streaming generate, and one-line errors with a non-zero exit."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from treeflash.cli import main
from treeflash.runtime import resolve


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A local model folder (the same loading path as a Hub id): tiny random Llama with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-target")
    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_bench_writes_the_documented_json(tiny_folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_folder, "--dataset", "gsm8k", "--limit", "2", "--methods", "pld",
                 "--max-new-tokens", "12", "--out", str(out), "--no-progress", "--dtype", "float32"]) == 0
    report = json.loads(out.read_text())
    assert report["target"] == tiny_folder and report["dataset"] == "gsm8k" and report["num_prompts"] == 2
    assert report["budgets"] == ["auto"] and report["temperature"] == 0.0 and report["max_new_tokens"] == 12
    assert report["dtype"] == "float32" and report["runtime"] == "static" and report["max_budget"] == 16
    assert report["weights"] == "dense"  # not a GGUF target
    assert set(report["methods"]) == {"ar", "pld"}
    for m in report["methods"].values():
        assert isinstance(m["tau"], float) and m["tau"] >= 1.0
        assert 0 <= m["ar_round_share"] <= 1 and 0 <= m["mean_tree_size"] <= 16
        assert m["tokens_per_second"] > 0 and m["speedup_vs_ar"] > 0
        assert m["matches_ar"] is True and 2 <= m["new_tokens"] <= 24
        lo, hi = m["speedup_vs_ar_interval"]
        assert lo <= m["speedup_vs_ar"] <= hi
        assert len(m["per_prompt"]) == 2 and sum(n for n, _ in m["per_prompt"]) == m["new_tokens"]
        assert m["tokens_per_second"] == pytest.approx(m["new_tokens"] / sum(s for _, s in m["per_prompt"]))
    assert report["methods"]["ar"]["tau"] == 1.0 and report["methods"]["ar"]["speedup_vs_ar_interval"] == [1.0, 1.0]
    ar, pld = report["methods"]["ar"], report["methods"]["pld"]
    assert ar["drafting_round_share"] == 0 and ar["draft_ms_per_drafting_round"] == 0  # ar never drafts
    # every round either ran the drafter or was an AR step that skipped it
    assert pld["drafting_round_share"] + pld["ar_round_share"] >= 1 - 1e-9 and pld["verify_ms_per_drafting_round"] >= 0
    table = capsys.readouterr().out
    assert "pld" in table and "speedup" in table


def test_bench_repeats_pool_each_prompts_runs(tiny_folder, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--target", tiny_folder, "--dataset", "gsm8k", "--limit", "2", "--methods", "pld",
            "--max-new-tokens", "6", "--no-progress", "--dtype", "float32"]
    assert main(args + ["--out", str(out)]) == 0
    once = json.loads(out.read_text())["methods"]
    assert main(args + ["--repeats", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["repeats"] == 3
    for name, m in report["methods"].items():  # the same greedy decodings, three times each
        assert m["new_tokens"] == 3 * once[name]["new_tokens"]
        assert m["matches_ar"] is True and m["prompts_matching_ar"] == 2


def test_speedup_interval_resamples_prompts_in_pairs():
    from treeflash.eval.bench import Totals, speedup_interval
    ar = Totals(per_prompt=[(100, 1.0), (10, 0.5), (50, 2.0), (80, 1.0)])  # prompts of unlike lengths and speeds
    twice = Totals(per_prompt=[(n, s / 2) for n, s in ar.per_prompt])
    assert speedup_interval(twice, ar) == pytest.approx((2.0, 2.0))  # 2x on every prompt: no spread at all
    mixed = Totals(per_prompt=[(n, s / f) for (n, s), f in zip(ar.per_prompt, (1.5, 2.5, 1.8, 2.2))])
    lo, hi = speedup_interval(mixed, ar)
    point = sum(n for n, _ in mixed.per_prompt) / sum(s for _, s in mixed.per_prompt) / (240 / 4.5)
    assert 1.5 < lo < point < hi < 2.5


def test_bench_batch_sizes(tiny_folder, tmp_path, capsys):
    out = tmp_path / "batch.json"
    assert main(["bench", "--target", tiny_folder, "--limit", "3", "--methods", "pld,hf", "--budget", "4",
                 "--batch-size", "1,2", "--max-new-tokens", "10", "--out", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["batch_sizes"] == [1, 2] and report["num_prompts"] == 3
    rows = report["variants"]
    assert set(rows) == {"ar B=1", "ar B=2", "pld@4 B=1", "pld@4 B=2"}
    for name, row in rows.items():
        assert row["matches_ar"] is True and row["prompts_matching_ar"] == 3 and row["tokens_per_second"] > 0
        assert row["speedup_vs_batch_1"] > 0 and 1 <= row["mean_batch"] <= row["batch_size"]
    assert rows["ar B=2"]["speedup_vs_ar"] == 1.0 and rows["pld@4 B=1"]["speedup_vs_batch_1"] == 1.0
    assert "not batched, skipped: hf" in capsys.readouterr().out


def test_bench_sweeps_budgets_in_one_run(tiny_folder, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_folder, "--dataset", "gsm8k", "--limit", "1", "--methods", "pld",
                 "--budget", "2,8", "--max-new-tokens", "10", "--out", str(out), "--no-progress"]) == 0
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"ar", "pld@2", "pld@8"}
    assert [methods[m]["budget"] for m in ("ar", "pld@2", "pld@8")] == [None, 2, 8]
    assert all(m["matches_ar"] for m in methods.values())


def test_bench_baselines_in_the_same_run(tiny_folder, tmp_path, capsys):
    """transformers' generate and its prompt lookup run beside ours; llama.cpp is skipped where not installed."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_folder, "--dataset", "gsm8k", "--limit", "2", "--methods",
                 "pld,hf,hf-pld,llamacpp", "--budget", "8", "--max-new-tokens", "10", "--out", str(out),
                 "--no-progress", "--dtype", "float32"]) == 0
    methods = json.loads(out.read_text())["methods"]
    for name in ("hf", "hf-pld"):
        m = methods[name]
        assert m["matches_ar"] is True and m["budget"] is None and m["tau"] >= 1.0 and m["speedup_vs_ar"] > 0
    assert methods["hf"]["tau"] == 1.0
    # llama-cpp-python is an optional extra, and it runs GGUF targets only
    why = methods["llamacpp"]["skipped"]
    assert "llama-cpp-python" in why or "GGUF" in why
    assert "skipped" in capsys.readouterr().out


@pytest.mark.real
def test_llamacpp_baselines_decode_the_embedded_gguf_in_their_own_process():
    pytest.importorskip("llama_cpp")
    from treeflash import Sampling, Target
    from treeflash.eval.baselines import make_baseline

    target = Target.load("smollm2-135m-instruct", dtype="float32", quantize="none")
    prompt = target.encode_prompt("Count from one to ten.")
    for name in ("llamacpp", "llamacpp-pld"):
        engine = make_baseline(name, target)
        tokens, seconds, forwards = engine(prompt, 16, Sampling(), seed=0)
        assert len(tokens) == 16 and seconds > 0 and 1 <= forwards <= 16
        assert engine.worker.poll() is None  # the worker lives on between requests
        assert engine(prompt, 16, Sampling(), seed=0)[0] == tokens  # greedy: the same answer again


def test_a_llamacpp_worker_killed_by_an_illegal_instruction_says_to_rebuild():
    """A wheel pip cached on another machine targets that machine's CPU: the worker dies of SIGILL at its first
    product, and the error says what to do."""
    import signal
    import subprocess
    import sys

    from treeflash.eval.baselines import BaselineUnavailable, LlamaCpp

    engine = LlamaCpp.__new__(LlamaCpp)
    engine.worker = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"],
                                     stdout=subprocess.PIPE, text=True)
    with pytest.raises(BaselineUnavailable, match=f"exit code -{int(signal.SIGILL)}.*--no-cache-dir"):
        engine._read()


def test_bench_at_temperature_has_no_exactness(tiny_folder, tmp_path):
    data = tmp_path / "mt.jsonl"
    data.write_text(json.dumps({"turns": ["Say hi.", "And bye."]}) + "\n" + json.dumps({"turns": ["Count."]}) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_folder, "--dataset", str(data), "--methods", "ar,pld", "--temperature",
                 "1", "--top-p", "0.9", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2 and report["methods"]["pld"]["matches_ar"] is None


def test_paired_writes_json(tiny_folder, tmp_path, capsys):
    out = tmp_path / "paired.json"
    assert main(["paired", "--target", tiny_folder, "--limit", "2", "--methods", "ar,pld", "--budget", "4,16",
                 "--temperature", "1", "--max-new-tokens", "10", "--out", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"pld@4", "pld@16"}  # ar has no tree to compare
    assert report["methods"]["pld@4"]["ratio_to_first"] == 1.0 and len(report["outputs"]) == 2
    assert all(m["expected_tau"] >= 1.0 for m in report["methods"].values())
    assert "E[tau]" in capsys.readouterr().out
    assert main(["paired", "--target", tiny_folder, "--methods", "ar"]) == 2  # nothing to compare


def test_generate_streams_and_prints_json(tiny_folder, capsys):
    assert main(["generate", "Hello", "--target", tiny_folder, "--max-new-tokens", "8"]) == 0
    streamed = capsys.readouterr()
    assert "tau" in streamed.err
    assert main(["generate", "Hello", "--target", tiny_folder, "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == len(result["tokens"]) <= 8
    assert streamed.out.strip() == result["text"].strip()


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--method", "nope"], "invalid choice"),
    (["bench", "--methods", "ar,nope"], "unknown method nope"),
    (["bench", "--dataset", "imagenet"], "unknown dataset"),
    (["bench", "--dataset", "/no/such/file.jsonl"], "no such file"),
    (["bench", "--budget", "0"], "budget"),
    (["bench", "--limit", "-3"], "limit"),
    (["bench", "--temperature", "-0.5"], "temperature"),
    (["bench", "--top-p", "0"], "top-p"),
    (["bench", "--top-p", "1.01"], "top-p"),
    (["generate", "   "], "empty"),
    (["generate", "hi", "--target", "/no/such/model"], "no model folder"),
    (["generate", "hi", "--target", "missing.gguf"], "no such GGUF"),
    (["serve", "--max-queue", "0"], "max-queue"),
    (["serve", "--timeout", "0"], "timeout"),
    (["serve", "--default-temperature", "-1"], "temperature"),
    (["serve", "--temperature", "0"], "--temperature"),  # a server's is the default of requests that name none
])
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_field_and_bad_json(tiny_folder, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q"}) + "\n")
    assert main(["bench", "--target", tiny_folder, "--dataset", str(data), "--field", "prompt"]) == 2
    assert "no field 'prompt'" in capsys.readouterr().err
    data.write_text("{not json\n")
    assert main(["bench", "--target", tiny_folder, "--dataset", str(data)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_serve_settings_and_the_open_address_warning(tiny_folder, monkeypatch, capsys):
    import treeflash.serve.app as serve_app

    calls = []
    monkeypatch.setattr(serve_app, "run", lambda *args: calls.append(args))  # no server: what it would serve
    monkeypatch.delenv("TREEFLASH_API_KEY", raising=False)
    assert main(["serve", "--target", tiny_folder, "--max-new-tokens", "7", "--max-queue", "3"]) == 0
    target, drafter, settings, budget, max_budget, max_queue, host, port, max_batch = calls[-1]
    assert (settings.model, settings.method, settings.api_key, settings.max_tokens) == (tiny_folder, "pld", None, 7)
    assert settings.temperature == 1.0  # OpenAI's default
    assert (drafter.name, budget, max_queue, host, port, max_batch) == ("pld", "auto", 3, "127.0.0.1", 8000, 1)
    assert main(["serve", "--target", tiny_folder, "--max-batch", "4"]) == 0 and calls[-1][-1] == 4
    assert main(["serve", "--target", tiny_folder, "--default-temperature", "0.3"]) == 0
    assert calls[-1][2].temperature == 0.3
    assert "warning" not in capsys.readouterr().err
    assert main(["serve", "--target", tiny_folder, "--host", "0.0.0.0", "--served-model-name", "m"]) == 0
    assert calls[-1][2].model == "m" and "without an API key" in capsys.readouterr().err
    monkeypatch.setenv("TREEFLASH_API_KEY", "k")
    assert main(["serve", "--target", tiny_folder, "--host", "0.0.0.0"]) == 0
    assert calls[-1][2].api_key == "k" and "warning" not in capsys.readouterr().err


def test_prompt_longer_than_the_context(tiny_folder, capsys):
    assert main(["generate", "word " * 400, "--target", tiny_folder]) == 2
    assert "context" in capsys.readouterr().err


def test_console_script_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "treeflash.cli", "bench", "--budget", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["treeflash: error: argument --budget: must be >= 1, got 0"]


def test_gdn_bench_json(capsys):
    assert main(["gdn-bench", "--tree-size", "8,70", "--heads", "2", "--dk", "16", "--dv", "16", "--repeats", "1",
                 "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)["sizes"]
    assert set(sizes) == {"8", "70"}
    for row in sizes.values():
        assert row["max_abs_err"] < 1e-4
        assert row["speedup_vs_branch_recurrent"] > 0 and row["speedup_vs_node_recurrent"] > 0
        assert row["stash_bytes"] < row["full_state_bytes"]


def test_available_methods_follow_the_drafter(tmp_path):
    from treeflash.cli import available_methods
    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash_config import DFlashConfig

    assert available_methods("smollm2-135m-instruct", None) == ["ar", "pld", "rest", "dflash", "ddtree", "treeflash",
                                                                "tfm"]  # a datastore and drafters ship for it
    config = DFlashConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, vocab_size=50, num_target_layers=2,
                          target_layer_ids=[0, 1], block_size=4)
    drafter = DFlashDrafter(config)
    drafter.save_pretrained(tmp_path / "dflash")
    drafter.add_ar_layer().save_pretrained(tmp_path / "treeflash")
    assert available_methods("smollm2-135m-instruct", str(tmp_path / "dflash")) == ["ar", "pld", "rest", "dflash",
                                                                                     "ddtree"]
    assert available_methods(str(tmp_path), None) == ["ar", "pld"]  # nothing ships for this one
    assert available_methods(str(tmp_path), None, datastore="d") == ["ar", "pld", "rest"]
    assert "treeflash" in available_methods("smollm2-135m-instruct", str(tmp_path / "treeflash"))
    assert "tfm" in available_methods("smollm2-135m-instruct", str(tmp_path / "dflash"), weaver="w")
    from treeflash.models.eagle3 import Eagle3Config, Eagle3Drafter

    Eagle3Drafter(Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=8, vocab_size=50, draft_vocab_size=50,
                               target_layer_ids=[0, 1, 1])).save_pretrained(tmp_path / "eagle3")
    assert available_methods("smollm2-135m-instruct", str(tmp_path / "eagle3")) == ["ar", "pld", "rest", "eagle3"]


def test_the_default_method_is_the_fastest_measured_on_the_device(tmp_path):
    """--method left out: prompt lookup on a CPU (block drafters do not pay there, docs/results/cpu-aoti), the
    shipped drafters' best method on a GPU, and what the named drafter allows."""
    from argparse import Namespace

    from treeflash.cli.decode import _choose_method

    def chosen(device, drafter=None):
        args = Namespace(method=None, target="smollm2-135m-instruct", drafter=drafter, weaver=None, datastore=None,
                         device=device)
        _choose_method(args)
        return args.method
    assert chosen("cpu") == "pld"
    assert chosen("cuda") == "treeflash"
    assert chosen("cuda:0", drafter=str(tmp_path / "plain")) == "ddtree"  # a drafter without a TreeFlash AR layer
