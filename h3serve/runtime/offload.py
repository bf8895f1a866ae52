"""Weights kept in pinned host memory: streamed to a GPU block by block (`[dit] offload = "group"`, `[encoder]
cpu_offload = true`), or copied to it whole for each request (`[vae] offload = "idle"`: `HostWhileIdle`).

diffusers' block-level group offload: each block of a ModuleList (one block per group) is copied to the GPU on a
side CUDA stream while the block before it runs, and dropped after it. The rest of the module it is applied to (and
of each of `block_modules`, to which it recurses) is one group onloaded whole, without the stream, when that module
runs; diffusers offloads such a group with `.to("cpu")`, so after its first run it lies in new pageable memory, not
in the arenas (read in diffusers 0.42.1, not measured). The weights are pinned in place first
(h3serve/runtime/pinned.py), so that the copies are asynchronous and host memory holds the weights once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from h3serve.runtime import pinned


def stream_from_host(
    module: torch.nn.Module,
    device: torch.device,
    block_modules: list[str] | None = None,
    use_stream: bool = True,
    arenas: pinned.Arenas | None = None,
) -> pinned.Arenas:
    """Keep `module`'s weights (on the CPU) in pinned host memory (`arenas`, or new ones), each block streamed to
    `device` as it runs. `use_stream=False` (ordinary host memory, no prefetch) runs the same hooks with the CPU as
    `device`, for tests. Returns the arenas that hold the weights."""
    from diffusers.hooks import apply_group_offloading

    # group offload with a stream pins a copy of every weight that is not pinned, keeping both until the first
    # forward (43.8 GiB twice in fp8): pinned in place, the weights are in host memory once
    arenas = pinned.pin_in_place(module, arenas or pinned.Arenas(pin=use_stream))
    apply_group_offloading(
        module,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=use_stream,
        block_modules=block_modules,
    )
    _own_host_copies(module)
    return arenas


def _own_host_copies(module: torch.nn.Module) -> None:
    """diffusers 0.42.1 keeps each weight's host copy keyed by the weight (`ModuleGroup.cpu_param_dict`). For a torchao
    weight already pinned that copy is the weight itself (`.cpu().pin_memory()` returns it), and the first onload
    swaps the GPU copy into it: the next onload then fails ("cannot pin 'CUDAFloat8_e4m3fnType'", one H200). Such an
    entry gets an object of its own over the same pinned parts."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    for submodule in module.modules():
        registry = getattr(submodule, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is not None:
            copies = hook.group.cpu_param_dict
            for tensor, copy in copies.items():
                if copy is tensor and pinned.parts(tensor):
                    copies[tensor] = pinned.alias(tensor)


class HostWhileIdle:
    """`[vae] offload = "idle"`: the modules' weights in pinned host memory between requests, copied to `device`
    whole for one (`on_device`) and dropped from it after. A service that shares a small card with others then holds
    none of it while they run; each request pays the copy (in its decode's time)."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device) -> None:
        self.device = device
        self.arenas = pinned.Arenas(pin=device.type == "cuda")
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []  # each weight and its pinned copy
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                if pinned.parts(tensor):
                    raise ValueError('offload = "idle" moves plain weights: it cannot take fp8 (torchao) ones')
                tensor.data = self.arenas.place(tensor.data)
                self._host.append((tensor, tensor.data))

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        for tensor, host in self._host:
            tensor.data = host.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            for tensor, host in self._host:
                tensor.data = host
