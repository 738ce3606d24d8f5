"""Copies between host and device that make the host wait as little as it must.

A plain `.to("cuda")` of a tensor in pageable memory blocks the host until the copy is done: one host
synchronisation per small tensor (ids, positions, masks, indices), several per round. From pinned memory the copy is
queued on the stream like a kernel, in order with the forward that reads it (PyTorch's pinned-memory pool keeps the
source alive until the copy has run). The other way, each `.tolist()` of a device tensor waits on its own:
`download` brings several back for one wait.
"""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, without a host synchronisation where the device is a GPU."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def download(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host, after one wait for the device (copies queued together); host tensors as they are."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors)
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream().synchronize()
    return copies
