"""A small training loop shared by the drafter trainers: AdamW, warm-up + cosine, clipping, DDP, exact resume.

Each run folder holds log.jsonl (a line per --log-every steps: losses, accuracy, the drafted positions trained so
far, where a step's time goes) and the same scalars as TensorBoard event files in tensorboard/.

Run it directly or under `torchrun --nproc_per_node N` (gloo on CPU, nccl on GPU): every process reads its own
share of the samples, and gradients are averaged by DistributedDataParallel. The sample order is a pure function
of (seed, step), so a resumed run sees exactly the samples, anchors and learning rates it would have seen.

A DDP step is a re-partition of the one-process step with the same --batch-size: sample slot s of a step goes to
process s % N, each sample's anchors come from a generator seeded by its slot, and each sample's loss counts
1 / batch size (a per-sample mean, then the mean over the batch), however many positions it drafts. The logged
figures are the whole batch's too (means and counts summed over the processes), not process 0's share.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from ..models.checkpoint import DrafterError, error_line, load_strict
from .losses import cosine_lr
from .processes import init_distributed


@dataclass
class TrainConfig:
    out: str
    steps: int = 1000
    batch_size: int | None = None  # sequences per optimizer step, over all processes (None: `batch_size_for`)
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    save_every: int = 100
    log_every: int = 10
    keep_every: int = 0  # also keep a drafter snapshot every this many steps (0: never), for learning curves
    seed: int = 0
    model_dir: str = "drafter"  # the trained model is saved to out/model_dir


DEFAULT_BATCH_SIZE = 4


def batch_size_for(requested: int | None, world: int) -> int:
    """Sequences per optimizer step over `world` processes: as requested (a multiple of the processes, each takes
    the same share), or by default DEFAULT_BATCH_SIZE rounded up to one (8 processes: 8)."""
    if requested is None:
        return -(-DEFAULT_BATCH_SIZE // world) * world
    if requested % world:
        raise ValueError(f"batch size {requested} must be a multiple of the {world} processes")
    return requested


@functools.lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The sample order of one epoch."""
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


CHECKPOINT_KEYS = ("model", "optim", "step")  # what a resume reads from checkpoint.pt
# A test hook: with this set to N, every process SIGKILLs itself in the middle of step N (gradients computed, the
# optimizer step not taken), as an OOM kill or a lost machine would; tests resume from there.
KILL_AT_STEP = "TREEFLASH_KILL_AT_STEP"


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")  # what a save cut short leaves: never read, replaced by the next save
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a broken checkpoint


def read_checkpoint(path: Path) -> dict:
    """A run's checkpoint.pt; one that cannot be read (truncated or corrupted, or not a checkpoint at all) is a
    one-line error naming it, never a traceback."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises several types here: RuntimeError, EOFError, UnpicklingError, ...
        raise DrafterError(f"{path} is not a readable training checkpoint (truncated or corrupted? {error_line(err)}); "
                           "delete it to start the run over, or use a new --out") from None
    if not isinstance(state, dict) or not all(key in state for key in CHECKPOINT_KEYS):
        raise DrafterError(f"{path} is not a treeflash training checkpoint (it needs {', '.join(CHECKPOINT_KEYS)}):"
                           " use a new --out")
    return state


def truncate_log(path: Path, step: int) -> None:
    """Keep the log lines of steps up to `step`, the checkpoint's: a run killed after its last save logged steps
    that the resumed run does (and logs) again; a line cut short by the kill goes too."""
    if not path.exists():
        return
    lines, kept = path.read_text().splitlines(keepends=True), []
    for line in lines:
        try:
            if line.endswith("\n") and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if kept != lines:
        path.write_text("".join(kept))


def sum_over_processes(values: list[float], device: torch.device) -> list[float]:
    """Each value summed over the processes (as it is in one process)."""
    if not dist.is_initialized():
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def train(model: torch.nn.Module, trainable: list[torch.nn.Parameter], samples: list,
          loss_fn: Callable[[torch.nn.Module, object, torch.Generator], tuple[torch.Tensor, dict]],
          cfg: TrainConfig, save_model: Callable[[Path], None], resume: bool = True) -> dict:
    """Optimise `trainable` params of `model` on `samples`; `loss_fn(model, sample, generator)` -> (loss, stats)."""
    rank, world = init_distributed()
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    batch_size = batch_size_for(cfg.batch_size, world)
    per_rank = batch_size // world
    wrapped = DistributedDataParallel(model) if world > 1 else model
    optim = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    step, positions, ckpt = 0, 0, out / "checkpoint.pt"
    if resume and ckpt.exists():
        state = read_checkpoint(ckpt)
        load_strict(model, state["model"], f"{ckpt} (a run of another model? use a new --out)")
        optim.load_state_dict(state["optim"])
        step = state["step"]
        positions = state.get("positions", 0)
    bar = tqdm(total=cfg.steps, initial=step, desc="train", disable=rank != 0, dynamic_ncols=True)
    if rank == 0:
        truncate_log(out / "log.jsonl", step)  # log.jsonl holds each step once, however often the run was resumed
    log = open(out / "log.jsonl", "a") if rank == 0 else None
    # the same figures as log.jsonl; purge_step hides the events of steps a resumed run does again
    board = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1) if rank == 0 else None
    device = next(model.parameters()).device  # where this process's tensors are (nccl reduces those)
    started, tokens, window, drafted = time.time(), 0, [], 0
    # where a step's time goes, in seconds per sequence (s_*: the loss_fn adds its own phases); wall time is the
    # truth on a CPU only, where nothing runs asynchronously
    timed = device.type == "cpu"
    while step < cfg.steps:
        lr = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup)
        for group in optim.param_groups:
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
        stats_sum: dict[str, torch.Tensor] = {}
        for micro in range(per_rank):
            slot = step * batch_size + micro * world + rank
            epoch, i = divmod(slot, len(samples))
            sample = samples[_permutation(cfg.seed, epoch, len(samples))[i]]
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + slot)  # anchors etc.: exact on resume
            sync = micro == per_rank - 1 or world == 1
            ctx = wrapped.no_sync() if not sync else nullcontext()  # DDP: reduce once per step
            with ctx:
                loss, stats = loss_fn(wrapped, sample, gen)
                t_forward = time.perf_counter()
                (loss / per_rank).backward()
            if timed:
                stats["s_backward"] = time.perf_counter() - t_forward
            for k, v in stats.items():  # tensors, summed where they are: read only when logged
                stats_sum[k] = stats_sum.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float32).detach() / per_rank
            drafted = drafted + torch.as_tensor(stats.get("tokens", 0)).detach()
        if os.environ.get(KILL_AT_STEP) == str(step + 1):  # tests only: a crash mid-step
            os.kill(os.getpid(), signal.SIGKILL)
        t_optim = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.clip)
        optim.step()
        step += 1
        if timed:
            stats_sum["s_optimizer"] = torch.tensor((time.perf_counter() - t_optim) / per_rank)  # a sequence's share
        window.append(stats_sum)
        logged = step % cfg.log_every == 0 or step == cfg.steps
        saved = step % cfg.save_every == 0 or step == cfg.steps
        if logged or saved:  # the drafted positions of all processes, counted up to every step a checkpoint holds
            new = round(sum_over_processes([float(drafted)], device)[0])
            tokens, positions, drafted = tokens + new, positions + new, 0
        if logged:  # the means over the window's steps and all processes' samples
            mean = {k: float(sum(w[k] for w in window)) / len(window) for k in window[0]}
            mean = dict(zip(mean, (v / world for v in sum_over_processes(list(mean.values()), device))))
        if rank == 0:
            bar.update()
            if logged:
                bar.set_postfix(loss=f"{mean.get('loss', 0):.3f}", acc=f"{mean.get('acc', 0):.3f}")
                record = {"lr": lr, "grad_norm": float(grad_norm), **mean, "positions": positions,
                          "elapsed_s": time.time() - started,
                          "tokens_per_second": tokens / (time.time() - started)}
                log.write(json.dumps({"step": step, **record}) + "\n")
                log.flush()
                for k, v in record.items():
                    board.add_scalar(k if k in ("loss", "kl", "acc", "acc_k1") else f"run/{k}", v, step)
                board.flush()
            if saved:
                atomic_save({"model": {k: v for k, v in model.state_dict().items()},
                             "optim": optim.state_dict(), "step": step, "positions": positions, "config": asdict(cfg)}, ckpt)
                save_model(out / cfg.model_dir)
            if cfg.keep_every and step % cfg.keep_every == 0:
                save_model(out / f"{cfg.model_dir}-step{step:06d}")
        if logged:
            window = []
    bar.close()
    if log:
        log.close()
        board.close()
    return {"steps": step, "seconds": time.time() - started, "tokens": tokens, "positions": positions}
