"""Block weights streamed from memory-mapped files to a GPU through a bounded pinned staging area (`[dit] offload =
"group"` with `fp8_cache_dir`: the weights are the fp8 store's files, h3serve/runtime/quantised_store.py).

Pinning every offloaded weight (h3serve/runtime/pinned.py) keeps the 43.8 GiB of the released transformer's fp8
weights in page-locked host memory for the life of the process: with a 49 GiB text encoder beside it, more than a
64 GB desktop has, and the OOM killer's target when adapters were added at start. Here each block's weights stay
where `torch.load(mmap=True)` put them, in the page cache, which the kernel can drop and read again; only the
staging buffers are pinned. A copy thread runs `PREFETCH` blocks ahead of the block the GPU runs:

    mapped file --memcpy, COPY_THREADS threads--> pinned staging slot --side CUDA stream--> the block's GPU buffer

A block's pre-forward hook waits for its buffer (on the GPU, an event), points the block's tensors at views of it and
asks for the next blocks; its forward hook points them back at the mapped files, which frees the buffer once the
compute stream is past it. The Python thread that launches the kernels runs far ahead of the GPU, so the copy
thread, before it allocates a block's buffer, waits until the GPU has finished the blocks that keep more than
`LIVE_BLOCKS` buffers alive (an event recorded after each block): without that, every block the launches raced
ahead to was allocated while the ones behind were still in use, and the caching allocator kept all of them. The
process's own memory is then `STAGING_SLOTS` blocks of pinned memory, whatever the model's size; the GPU holds the
rest of the model and `LIVE_BLOCKS` blocks.

Everything of a block that is not streamed (adapters' low-rank factors, which requests rewrite in place; buffers the
skeleton computed) lives on the GPU like the rest of the model.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from h3serve.runtime import pinned

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TraceableWrapperSubclass

log = logging.getLogger("h3serve.weight_stream")
PREFETCH = 2  # blocks copied ahead of the one running: the copy thread never waits for the GPU to ask
LIVE_BLOCKS = PREFETCH + 2  # block buffers on the GPU at most: the one running, the one finishing, those ahead
RELEASE_WAIT_S = 5.0  # a buffer a failed forward never gave back is not waited for longer than this
STAGING_SLOTS = 2  # pinned buffers of one block each: one being filled while the other's copy to the GPU runs
COPY_THREADS = 8  # threads copying from the page cache into a slot (one memcpy runs at a few GB/s)
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Part:
    """One streamed tensor: `owner`'s data (attribute None) or one of a torchao tensor's parts, and where it lies."""

    owner: torch.Tensor
    attribute: str | None
    source: torch.Tensor  # in host memory, memory-mapped
    offset: int  # in the block's buffer

    def point_at(self, tensor: torch.Tensor) -> None:
        if self.attribute is None:
            self.owner.data = tensor
        else:
            setattr(self.owner, self.attribute, tensor)

    def view_in(self, buffer: torch.Tensor) -> torch.Tensor:
        return _view(buffer, self.offset, self.source)


@dataclass
class Onload:
    """One block's copy to the device: done when `ready` is set (on a GPU, once `event` has passed)."""

    ready: threading.Event = field(default_factory=threading.Event)
    buffer: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    error: BaseException | None = None


@dataclass
class Slot:
    buffer: torch.Tensor
    event: torch.cuda.Event | None = None  # the last copy out of it


class BlockStream:
    """Streams the tensors of the module list `blocks` of `model` that are in `streamed` (by identity: the mapped
    ones) to `device` as each block runs; every other tensor of `model` moves to `device` now."""

    def __init__(self, model: torch.nn.Module, blocks: str, streamed: set[int], device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        module_list = cast(torch.nn.ModuleList, model.get_submodule(blocks))  # `blocks` names a module list
        self.parts: list[list[Part]] = []
        for index, block in enumerate(module_list):
            self.parts.append(_layout(block, streamed))
            block.register_forward_pre_hook(lambda module, args, i=index: self._before(i))
            block.register_forward_hook(lambda module, args, output, i=index: self._after(i))
        staged = {id(part.owner) for parts in self.parts for part in parts}
        _move_others(model, staged, device)
        self.block_bytes = [
            max((p.offset + pinned.span_bytes(p.source) for p in parts), default=0) for parts in self.parts
        ]
        largest = max(self.block_bytes, default=0)
        self.slots = [Slot(torch.empty(largest, dtype=torch.uint8, pin_memory=self.cuda)) for _ in range(STAGING_SLOTS)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.onloads: dict[int, Onload] = {}
        self.requests: queue.Queue[tuple[int, Onload]] = queue.Queue()
        self.released: queue.Queue[torch.cuda.Event | None] = queue.Queue()  # one per block buffer given back
        self.live = 0  # block buffers allocated and not yet known to be finished with
        self.peak_live = 0
        self.copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="stream-copy")
        threading.Thread(target=self._copy_loop, name="weight-stream", daemon=True).start()
        log.info(
            "%d blocks (%.1f GiB) streamed to %s from memory-mapped files through %d pinned slots of %d MiB",
            len(self.parts),
            sum(self.block_bytes) / 2**30,
            device,
            STAGING_SLOTS,
            largest >> 20,
        )

    def _request(self, index: int) -> Onload:
        if index not in self.onloads:
            self.onloads[index] = Onload()
            self.requests.put((index, self.onloads[index]))
        return self.onloads[index]

    def _before(self, index: int) -> None:
        onload = self._request(index)
        onload.ready.wait()
        if onload.error is not None:
            self.onloads.pop(index, None)  # the next forward asks again: a failed copy (out of memory) may pass then
            raise RuntimeError(f"block {index}'s weights could not be streamed to {self.device}") from onload.error
        buffer = onload.buffer
        assert buffer is not None  # _copy sets it whenever it did not fail
        if onload.event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(onload.event)
            buffer.record_stream(compute)  # freed only once the compute stream is past this block
        for part in self.parts[index]:
            part.point_at(part.view_in(buffer))
        for ahead in range(1, PREFETCH + 1):  # wraps around: the next forward starts at block 0
            self._request((index + ahead) % len(self.parts))

    def _after(self, index: int) -> None:
        for part in self.parts[index]:
            part.point_at(part.source)
        self.onloads.pop(index, None)
        done = torch.cuda.Event() if self.cuda else None
        if done is not None:
            done.record(torch.cuda.current_stream(self.device))
        self.released.put(done)

    def _copy_loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        for count in itertools.count():
            index, onload = self.requests.get()
            try:
                self._copy(index, onload, self.slots[count % len(self.slots)])
            except BaseException as exc:  # noqa: BLE001 - handed to the forward that needs the block
                onload.error = exc
            onload.ready.set()

    def _copy(self, index: int, onload: Onload, slot: Slot) -> None:
        if slot.event is not None:
            slot.event.synchronize()  # its last copy to the GPU has read it
        size = self.block_bytes[index]
        _copy_into(slot.buffer, [(part.source, part.offset) for part in self.parts[index]], self.copiers)
        self._wait_for_room()  # after the memcpy: the host's copy overlaps the wait for the GPU
        if not self.cuda:
            onload.buffer = slot.buffer[:size].clone()
        else:
            with torch.cuda.stream(self.copy_stream):
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
                buffer.copy_(slot.buffer[:size], non_blocking=True)
                slot.event = onload.event = torch.cuda.Event()
                onload.event.record(self.copy_stream)
            onload.buffer = buffer
        self.live += 1  # counted once allocated: a failed allocation holds nothing that will be given back
        self.peak_live = max(self.peak_live, self.live)

    def _wait_for_room(self) -> None:
        """Block until fewer than LIVE_BLOCKS buffers are in use on the GPU (module docstring). A buffer that a forward
        which raised never gave back is counted out after RELEASE_WAIT_S, so a failed request cannot stop the stream."""
        while self.live >= LIVE_BLOCKS:
            try:
                done = self.released.get(timeout=RELEASE_WAIT_S)
            except queue.Empty:
                log.warning("no block buffer given back in %.0f s: streaming on", RELEASE_WAIT_S)
                self.live -= 1
                continue
            if done is not None:
                done.synchronize()
            self.live -= 1


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of `buffer` from `offset` seen as a tensor with `like`'s dtype, shape and strides."""
    span = pinned.span_bytes(like)
    return buffer[offset : offset + span].view(like.dtype).as_strided(like.shape, like.stride())


def _copy_into(buffer: torch.Tensor, staged: list[tuple[torch.Tensor, int]], copiers: ThreadPoolExecutor) -> None:
    """Each (host tensor, offset) copied into host `buffer` at its offset, CHUNK_BYTES at a time over the copiers'
    threads (one memcpy runs at a few GB/s; ctypes releases the GIL)."""
    chunks = [
        (buffer.data_ptr() + offset + start, source.data_ptr() + start, min(CHUNK_BYTES, span - start))
        for source, offset in staged
        for span in [pinned.span_bytes(source)]
        for start in range(0, span, CHUNK_BYTES)
    ]
    list(copiers.map(lambda chunk: ctypes.memmove(*chunk), chunks))


def _layout(block: torch.nn.Module, streamed: set[int]) -> list[Part]:
    """The block's streamed tensors (a torchao tensor part by part) at aligned offsets of one buffer."""
    parts, offset = [], 0
    for tensor in [*block.parameters(), *block.buffers()]:
        if id(tensor) not in streamed:
            continue
        for attribute, source in _pieces(tensor):
            parts.append(Part(tensor, attribute, source, offset))
            offset += -(-pinned.span_bytes(source) // pinned.ALIGN) * pinned.ALIGN
    return parts


def _pieces(tensor: torch.Tensor) -> list[tuple[str | None, torch.Tensor]]:
    names = pinned.parts(tensor)
    return [(name, getattr(tensor, name)) for name in names] if names else [(None, tensor.data)]


def _move_others(model: torch.nn.Module, staged: set[int], device: torch.device) -> None:
    """Every tensor of `model` not streamed moves to `device` (the streamed ones stay mapped)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in staged:
            continue
        for attribute, piece in _pieces(tensor):
            Part(tensor, attribute, piece, 0).point_at(piece.to(device))


UPLOAD_SLOT_BYTES = 256 << 20  # a staging slot of move_to_device (or the largest tensor, when larger)


def move_to_device(model: torch.nn.Module, device: torch.device) -> None:
    """Every tensor of `model` (in host memory: the quantised store's memory-mapped files) moved to `device` for good,
    through `STAGING_SLOTS` pinned slots: COPY_THREADS threads copy a slot's worth of tensors out of the page cache
    while the slot before it crosses to the GPU on a side stream. `model.to(device)` copies each tensor from pageable
    memory by itself, the pages faulted in by one thread: the fp8 transformer's 43.8 GiB took about 15 s on one H100
    (docs/deploy/single-h100.md). A torchao tensor becomes a new one over its moved parts. On the CPU (tests) the
    same path runs without pinning or streams."""
    cuda, started = device.type == "cuda", time.perf_counter()
    owned = [
        (module, name, tensor, is_parameter)
        for module in model.modules()
        for is_parameter, named in ((True, module.named_parameters), (False, module.named_buffers))
        for name, tensor in named(recurse=False)
    ]
    tensors = {id(tensor): tensor for _, _, tensor, _ in owned}  # a tensor two modules share moves once
    pieces = [(key, attribute, source) for key, tensor in tensors.items() for attribute, source in _pieces(tensor)]
    spans = [-(-pinned.span_bytes(source) // pinned.ALIGN) * pinned.ALIGN for _, _, source in pieces]
    slot_bytes = max([UPLOAD_SLOT_BYTES, *spans])
    slots = [Slot(torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda)) for _ in range(STAGING_SLOTS)]
    stream = torch.cuda.Stream(device) if cuda else None
    moved: dict[int, dict[str | None, torch.Tensor]] = {}  # each tensor's moved pieces, by attribute
    with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="upload-copy") as copiers:
        for number, group in enumerate(_slot_groups(spans, slot_bytes)):
            slot = slots[number % len(slots)]
            if slot.event is not None:
                slot.event.synchronize()  # the GPU has read what the slot held before
            staged = [(pieces[index], offset) for index, offset in group]
            _copy_into(slot.buffer, [(source, offset) for (_, _, source), offset in staged], copiers)
            with torch.cuda.stream(stream):
                for (key, attribute, source), offset in staged:
                    target = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device=device)
                    target.copy_(_view(slot.buffer, offset, source), non_blocking=cuda)
                    moved.setdefault(key, {})[attribute] = target
                if stream is not None:
                    slot.event = torch.cuda.Event()
                    slot.event.record(stream)
    if stream is not None:
        stream.synchronize()  # the slots are freed on return: their copies must have finished
    replaced = {key: _rebuilt(tensors[key], parts) for key, parts in moved.items()}
    for module, name, tensor, is_parameter in owned:
        if is_parameter:
            if not isinstance(replaced[id(tensor)], torch.nn.Parameter):  # one Parameter for modules that share it
                replaced[id(tensor)] = torch.nn.Parameter(replaced[id(tensor)], tensor.requires_grad)
            module._parameters[name] = cast(torch.nn.Parameter, replaced[id(tensor)])
        else:
            module._buffers[name] = replaced[id(tensor)]
    seconds = time.perf_counter() - started
    total = sum(spans) / 2**30
    log.info(
        "%.1f GiB moved to %s through pinned slots in %.1f s (%.1f GiB/s)", total, device, seconds, total / seconds
    )


def _rebuilt(tensor: torch.Tensor, parts: dict[str | None, torch.Tensor]) -> torch.Tensor:
    """`tensor` over its moved pieces: the plain tensor itself, or a torchao tensor of the moved parts."""
    if None in parts:
        return parts[None]
    return pinned.alias(cast("TraceableWrapperSubclass", tensor), cast(dict[str, torch.Tensor], parts))


def _slot_groups(spans: list[int], slot_bytes: int) -> list[list[tuple[int, int]]]:
    """The pieces (by index, each `spans` bytes) in order, in groups that fill a slot: (index, offset in the slot)."""
    groups: list[list[tuple[int, int]]] = [[]]
    used = 0
    for index, span in enumerate(spans):
        if used + span > slot_bytes and groups[-1]:
            groups.append([])
            used = 0
        groups[-1].append((index, used))
        used += span
    return [group for group in groups if group]
