"""A model process's CUDA memory: the allocator cap at start (`memory_limit_gib`) and the cache release after
each request.

Several services may share one GPU; each process's caching allocator keeps what a request freed, so one
process's cache can starve the next stage (on one H200 at 768x1344x124 the DiT process held 77 GiB, the
encoder 51 GiB, and the VAE decode ran out of memory). `release` hands the cache back after every request;
`cap` bounds a process to `memory_limit_gib` (e.g. to emulate a 22 GB card on a bigger one).
`h3serve plan` predicts whether the caps and the cards fit (h3serve/common/memory_plan.py).
"""

from __future__ import annotations

import logging

import torch

from h3serve.common.memory_plan import GIB, limit_fraction

log = logging.getLogger("h3serve.memory")


class MemoryLimitError(ValueError):
    """memory_limit_gib cannot be applied to this device (above its total)."""


def capped_devices(config, device) -> list[torch.device]:
    """The CUDA devices `config.memory_limit_gib` caps for a process on `device`: none off CUDA or without a limit;
    every visible GPU for an encoder spread over them; else the device (its index, or the current one)."""
    device = torch.device(device)
    if not config.memory_limit_gib or device.type != "cuda":
        return []
    if getattr(config, "spread", False):
        return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return [torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)]


def fractions(config, device) -> list[tuple[torch.device, float]]:
    """(device, fraction of its total) for every capped device; MemoryLimitError names the limit and the total."""
    found = []
    for cuda in capped_devices(config, device):
        try:
            found.append(
                (cuda, limit_fraction(config.memory_limit_gib, torch.cuda.get_device_properties(cuda).total_memory))
            )
        except ValueError as exc:
            raise MemoryLimitError(f"{cuda}: {exc}") from None
    return found


def cap(config, device) -> None:
    """Cap this process's CUDA allocator at `memory_limit_gib` on its device(s), before any weights load."""
    for cuda, fraction in fractions(config, device):
        torch.cuda.set_per_process_memory_fraction(fraction, cuda)
        log.info(
            "memory_limit_gib %g: allocator capped on %s at %.1f%% of its %.2f GiB",
            config.memory_limit_gib,
            cuda,
            100 * fraction,
            torch.cuda.get_device_properties(cuda).total_memory / GIB,
        )


def release(device) -> None:
    """Give the allocator's cached, unused blocks back to the driver after a request, so another process on the
    same GPU can use them. Cheap next to a request (one synchronising cudaFree per cached segment, milliseconds;
    the next request's first allocations pay a few cudaMallocs); a no-op off CUDA. Logs the process's peaks first:
    what it held at most is what the services sharing a card must add up to (h3serve plan predicts it)."""
    if torch.device(device).type == "cuda":
        log.info("GPU memory after a request: %s", peaks(device))
        torch.cuda.empty_cache()


def peaks(device) -> str:
    """This process's allocator on `device` since it started: the most it reserved from the driver and the most its
    tensors used, and what it reserves now. The CUDA context (about 0.5 GiB) comes on top of every figure."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not on a GPU"
    return (
        f"peak reserved {torch.cuda.max_memory_reserved(device) / GIB:.2f} GiB, "
        f"peak allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB, "
        f"reserved now {torch.cuda.memory_reserved(device) / GIB:.2f} GiB"
    )
