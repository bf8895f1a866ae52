"""Weights page-locked in host memory, for a model that streams them to a GPU (h3serve/runtime/offload.py).

Copies from pinned memory run asynchronously beside the compute; from pageable memory they do not. torch's pinned
allocator rounds every allocation up to a power of two, so pinning the released transformer's fp8 weights tensor by
tensor would take 59.0 GiB for 43.8 GiB of weights. `pin_in_place` packs them instead into arenas of exactly
`ARENA_BYTES` (a power of two, so nothing is rounded), each tensor a view with its own shape and strides, and
replaces every weight by its view one tensor at a time: host memory holds the weights once (45 arenas of 1 GiB for
those 43.8 GiB on one H200 machine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TraceableWrapperSubclass

ARENA_BYTES = 1 << 30  # a power of two: the pinned allocator gives exactly this
ALIGN = 512  # each tensor of an arena starts at a multiple of this, as an allocation would


class Arenas:
    """First-fit allocation of tensors into pinned arenas (`pin=False`: ordinary host memory, for tests on a CPU).
    First fit, not the last arena only: with the released transformer's AdaLN projections (347 MB each) filling
    only the last arena left up to a third of each empty (52 arenas for 43.8 GiB; 45 with first fit)."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self.arenas: list[torch.Tensor] = []
        self.used: list[int] = []  # bytes taken in each arena

    @property
    def count(self) -> int:
        return len(self.arenas)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in an arena, with its dtype, shape and strides."""
        span = span_bytes(tensor)
        if span > ARENA_BYTES:  # larger than an arena: its own allocation (rounded, but no weight is this large)
            return tensor.pin_memory() if self.pin else tensor.clone()
        index = next((i for i, used in enumerate(self.used) if used + span <= ARENA_BYTES), len(self.arenas))
        if index == len(self.arenas):
            self.arenas.append(torch.empty(ARENA_BYTES, dtype=torch.uint8, pin_memory=self.pin))
            self.used.append(0)
        start = self.used[index]
        view = self.arenas[index][start : start + span].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
        view.copy_(tensor)
        self.used[index] = start + -(-span // ALIGN) * ALIGN
        return view


def span_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor`'s elements span in memory, given its strides."""
    if tensor.numel() == 0:
        return 0
    elements = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return elements * tensor.element_size()


def parts(tensor: torch.Tensor) -> list[str]:
    """The plain tensors a torchao quantised tensor is made of (its data and scales), by attribute; [] for others."""
    kind = type(tensor)
    names = (*getattr(kind, "tensor_data_names", ()), *getattr(kind, "optional_tensor_data_names", ()))
    return [name for name in names if getattr(tensor, name, None) is not None]


def alias(tensor: TraceableWrapperSubclass, parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """A second torchao tensor object over `tensor`'s own parts, or over `parts` in their place (no copy)."""
    names, attributes = tensor.__tensor_flatten__()
    parts = parts or {}
    return type(tensor).__tensor_unflatten__(
        {name: parts.get(name, getattr(tensor, name)) for name in names}, attributes, tensor.size(), tensor.stride()
    )


def pin_in_place(model: torch.nn.Module, arenas: Arenas | None = None) -> Arenas:
    """Move every parameter and buffer of `model` (on the CPU) into pinned arenas, one tensor at a time; a torchao
    tensor part by part, as diffusers' offload itself moves them. Returns the arenas, for their count."""
    arenas = arenas or Arenas()
    replace_tensors(model, arenas.place)
    return arenas


def replace_tensors(model: torch.nn.Module, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every parameter and buffer of `model` replaced by `place(tensor)`, one at a time (the old memory is freed as
    it goes); a torchao tensor's parts (its data and scales) one by one, the tensor object kept."""
    for tensor in [*model.parameters(), *model.buffers()]:
        names = parts(tensor)
        for name in names:
            setattr(tensor, name, place(getattr(tensor, name)))
        if not names:
            tensor.data = place(tensor.data)
