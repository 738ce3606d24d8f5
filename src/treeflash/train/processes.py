"""The processes of a run under torchrun: which share is this one's, on which GPU, and the process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def process_share() -> tuple[int, int]:
    """(rank, processes) of this process (alone: (0, 1)), its GPU made current: a target or model loaded after
    goes onto it, and NCCL binds a process to the device that is current when its group starts."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed() -> tuple[int, int]:
    """`process_share`, and the process group started where torchrun launched several (nccl on GPUs, else gloo)."""
    rank, world = process_share()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return rank, world
