"""Small host<->device copies of the sampler's that never wait for the device's queued work."""

from __future__ import annotations

import torch


def to_host_async(tensors: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """Start copying ``tensors`` to the host: on a GPU into pinned memory, with an event to wait
    on (a blocking copy would wait for every step queued after them too, a step launched ahead
    included); elsewhere they are there already."""
    if tensors[0].device.type != "cuda":
        return tuple(tensors), None
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device: from pinned memory, copied
    asynchronously, where the device is a GPU (a copy from pageable memory waits for the stream's
    earlier work, which would keep the next step from launching before this one has finished)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
