"""Training you can trust: two DDP processes train the weights one process does with the same global batch, and a
run killed mid-step (SIGKILL, between two saves) resumes to the weights of a run never killed: the DFlash drafter,
the TreeFlash AR layer on a frozen backbone and the Weaver, and DFlash under DDP."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import treeflash
from treeflash.cli import main
from treeflash.train.trainer import KILL_AT_STEP

from test_cli import tiny_folder  # noqa: F401  (fixture)
from test_train import write_store

# DDP's all-reduce adds the two processes' gradients in another order than one process accumulates them: fp32
# rounding, a few ulps of weights ~0.1 after 6 steps. One Adam step moves a weight by about lr (6e-4), so a sample
# lost, doubled or given the wrong anchors is far above this.
DDP_ATOL = 1e-6
LOG_RTOL = 1e-5  # the logged means: the same sums in another order
STEPS, SAVE_EVERY, LOG_EVERY = 6, 3, 2
KILL_AT = 5  # saved at step 3; step 4 trained and logged, then lost with the kill: the resume does it again


@pytest.fixture
def one_thread():
    """The runs take --threads 1 (the same sums in every process, in-process or not); the test process gets its
    own thread count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train_args(kind, tmp_path, target, out, batch_size=2):
    args = ["train", kind, "--target", target, "--data", str(tmp_path / "regen"), "--data-dir",
            str(tmp_path / "data"), "--out", str(out), "--steps", str(STEPS), "--batch-size", str(batch_size),
            "--num-anchors", "4", "--save-every", str(SAVE_EVERY), "--log-every", str(LOG_EVERY),
            "--target-dtype", "float32", "--no-bf16", "--threads", "1"]
    if kind == "dflash":
        return args + ["--layers", "1", "--taps", "2", "--block-size", "4"]
    backbone = str(tmp_path / "backbone")
    if kind == "treeflash":
        return args + ["--backbone", backbone, "--freeze-backbone"]
    return args + ["--backbone", backbone, "--top-k", "16"]


def save_backbone(tmp_path, target) -> None:
    """A random DFlash drafter for the adapters to train on."""
    from transformers import AutoConfig

    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash_config import DFlashConfig

    torch.manual_seed(0)
    config = DFlashConfig.for_target(AutoConfig.from_pretrained(target), num_layers=1, num_taps=2, block_size=4,
                                     mask_token_id=16)
    DFlashDrafter(config).save_pretrained(tmp_path / "backbone", dtype=torch.float32)


def cli(args, processes=1, kill_at=None):
    """`treeflash ...` in a new process (under torchrun for several), importing the treeflash this test does;
    `kill_at`: the step it SIGKILLs itself in."""
    env = {k: v for k, v in os.environ.items() if k != KILL_AT_STEP}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(treeflash.__file__).parents[1]), env.get("PYTHONPATH", "")])
    if kill_at is not None:
        env[KILL_AT_STEP] = str(kill_at)
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--standalone"]
    return subprocess.run([*launcher, "-m", "treeflash.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def checkpoint(out):
    return torch.load(out / "checkpoint.pt", weights_only=False)


def log(out):
    return [json.loads(line) for line in open(out / "log.jsonl")]


def progress(out):
    """What a log's lines say of the run's path: steps, learning rates, gradient norms, positions trained."""
    return [(r["step"], r["lr"], r["grad_norm"], r["positions"]) for r in log(out)]


def assert_same_weights(a, b, atol):
    assert a["step"] == b["step"] == STEPS and a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")
    assert a["positions"] == b["positions"]  # the drafted positions trained, counted once each


def assert_same_optimizer(a, b):
    a, b = a["optim"], b["optim"]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i, state in a["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(v, b["state"][i][k], atol=0, rtol=0, msg=lambda m: f"optim {i} {k}: {m}")


def kill_then_resume(args, processes=1):
    """Run `args` killed mid-step KILL_AT, then again to resume it; returns the run folder."""
    out = Path(args[args.index("--out") + 1])
    killed = cli(args, processes, kill_at=KILL_AT)
    assert killed.returncode != 0, killed.stderr[-2000:]
    assert checkpoint(out)["step"] == 3 and [r["step"] for r in log(out)] == [2, 4]  # step 4 logged, not saved
    if processes == 1:
        assert main(args) == 0  # in this process: cheaper than another start
    else:
        resumed = cli(args, processes)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
    return out


@pytest.mark.parametrize("kind", ["dflash", "treeflash", "weaver"])
def test_a_run_killed_mid_step_resumes_to_the_same_weights(kind, tmp_path, tiny_folder, one_thread):  # noqa: F811
    write_store(tmp_path, tiny_folder)
    if kind != "dflash":
        save_backbone(tmp_path, tiny_folder)
    resumed = kill_then_resume(train_args(kind, tmp_path, tiny_folder, tmp_path / "resumed"))
    straight = tmp_path / "straight"
    assert main(train_args(kind, tmp_path, tiny_folder, straight)) == 0
    a, b = checkpoint(straight), checkpoint(resumed)
    assert_same_weights(a, b, atol=0)
    assert_same_optimizer(a, b)
    assert progress(resumed) == progress(straight)  # each step logged once, the positions counted once
    assert [r["step"] for r in log(resumed)] == [2, 4, 6]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_folder):  # noqa: F811
    """A DFlash run of 2 gloo processes, global batch 4 (2 sequences per process, gradients accumulated)."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    write_store(tmp_path, tiny_folder)
    out = tmp_path / "ddp"
    done = cli(train_args("dflash", tmp_path, tiny_folder, out, batch_size=4), processes=2)
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp_path, out


def test_two_ddp_processes_train_the_weights_of_one(ddp_run, tiny_folder, one_thread):  # noqa: F811
    tmp_path, ddp = ddp_run
    one = tmp_path / "one"
    assert main(train_args("dflash", tmp_path, tiny_folder, one, batch_size=4)) == 0
    assert_same_weights(checkpoint(ddp), checkpoint(one), atol=DDP_ATOL)
    # the log holds the whole batch's figures, not process 0's half
    for a, b in zip(log(ddp), log(one), strict=True):
        assert a["step"] == b["step"] and a["positions"] == b["positions"]
        for k in ("loss", "kl", "acc", "tokens", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=LOG_RTOL), (a["step"], k)


def test_a_ddp_run_killed_mid_step_resumes_to_the_same_weights(ddp_run, tiny_folder):  # noqa: F811
    tmp_path, straight = ddp_run
    resumed = kill_then_resume(train_args("dflash", tmp_path, tiny_folder, tmp_path / "resumed", batch_size=4), 2)
    a, b = checkpoint(straight), checkpoint(resumed)
    assert_same_weights(a, b, atol=0)
    assert_same_optimizer(a, b)
    assert progress(resumed) == progress(straight)


def test_regen_shared_by_two_processes_answers_every_prompt_once(tmp_path, tiny_folder):  # noqa: F811
    """`data regen` under torchrun: each process answers its share into the same store (appends take turns),
    and the store holds what one process writes: every prompt once, the same greedy answers."""
    from test_train import _gsm8k_prompts
    from treeflash.train.store import AnswerStore

    data = _gsm8k_prompts(tmp_path, 7)
    args = ["data", "regen", "--target", tiny_folder, "--data-dir", str(data), "--sources", "gsm8k", "--batch-size",
            "2", "--shard-size", "2", "--max-new-tokens", "5", "--dtype", "float32"]
    shared = cli([*args, "--out", str(tmp_path / "shared")], processes=2)
    alone = cli([*args, "--out", str(tmp_path / "alone")])
    assert shared.returncode == alone.returncode == 0, shared.stderr[-2000:]
    answers = [{a.id: a.response_ids for a in AnswerStore(tmp_path / name).answers()} for name in ("shared", "alone")]
    assert len(answers[0]) == 7 and answers[0] == answers[1]
    store = AnswerStore(tmp_path / "shared")
    assert store.verify() == [] and sum(e["answers"] for e in store.entries()) == 7
