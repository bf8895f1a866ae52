"""Quantised weights saved once and assigned at every later start: the DiT's fp8 (`[dit] fp8_cache_dir`) and the
text encoder's int8 (`[encoder] int8_cache_dir`).

With `fp8 = true` a start loads (or, for `random:full`, builds) the bf16 transformer and then quantises its block
linears: 65.5 s and 42 s of the 32 GB profile's 214.8 s start on one H200 (BENCHMARKS.md); the int8 encoder's
layers took 25.5 s of the one-H100 profile's start (docs/deploy/single-h100.md). A restart did both again for the
same result. The first start with a cache directory saves each quantised partition; a later start builds the
module on the meta device and assigns the saved tensors, memory-mapped, so the bf16 weights are never read and
nothing is quantised again.

A partition is a directory of one `torch.save` file per block of its `Layout` (the transformer's
`transformer_blocks`, the encoder's decoder layers) and one for the rest (`rest.pt`; torchao's fp8 and int8 tensors
load with `weights_only`), so that nothing about a partition needs more host memory than one block: `build`
quantises block by block on the GPU straight from the model source into the files (the 32 GB profile's start never
holds the 61.7 GiB of bf16 weights), and group offload streams each block from its memory-mapped file
(h3serve/runtime/weight_stream.py). The directory is written aside and renamed when complete, so a process killed
while writing leaves nothing a later start takes for whole; a later save deletes what dead ones left.

The key names everything the tensors depend on: the weights (`ModelSource.revision`), the partition, the dtype, the
layout's quantisation recipe, the torch and torchao versions. Not the adapters: they are installed over the
quantised base as unmerged low-rank branches (h3serve/services/dit/adapters.py), so one cache serves every adapter
set. A partition that does not load (a truncated file, an incompatible torchao) is deleted with a warning and
quantised again; a save that fails (a full disk) is a warning too: the cache speeds a start up, it never stops one.

Writing took 69.9 s of a 137.5 s cold start of a resident transformer on one H200 (44 GiB; docs/performance.md), so
weights that are served from the GPU are written in the background (`save_later`): the tensors written are the ones
served, which nothing changes, so the save holds no second copy of them. It runs beside the warm-up, and
`before_serving` holds health NOT_SERVING until it is written (`[dit] fp8_save = "before_serving"`, the default): on one
H100 a save left running after SERVING took 66.5 s and slowed the first request's three DiT forwards from 3.4 s to
13.9 s. Holding SERVING costs a first start only what of the save outlasts the warm-up, and no request ever shares
the machine with it; "background" turns SERVING at once, for a deployment that would rather serve sooner. The
encoder's int8 is always written as it is built (`build`), before its service serves.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from h3serve.common.errors import describe
from h3serve.runtime import sharded_load

log = logging.getLogger("h3serve.quantised_store")
REST = "rest"  # the file of everything outside the blocks


@dataclass(frozen=True)
class Layout:
    """One kind of quantised partition: what quantised it and which module list gets a file per block."""

    kind: str  # "fp8", "int8": the directories' and the log's word for the weights
    blocks: str  # the module list (a dotted path) whose blocks get a file each (and stream one by one)
    # what quantised the blocks and how they are laid out on disk; change it whenever either changes, so no start
    # assigns weights quantised or stored otherwise
    recipe: str

    def group_of(self, name: str) -> str:
        """The file a state-dict entry lives in: `<blocks>.<i>` for a block's, `rest` for all others."""
        head = self.blocks + "."
        return head + name[len(head) :].partition(".")[0] if name.startswith(head) else REST


@dataclass(frozen=True)
class Build:
    """What `QuantisedStore.build` quantises a partition from, and how."""

    weights: sharded_load.Weights  # the values (the model directory's files, or random:full's draws)
    skeleton: Callable[[], torch.nn.Module]  # the partition on the meta device, as the store assigns it
    device: torch.device  # where each block is filled and quantised
    quantize: Callable[[torch.nn.Module, str], None]  # (block, its name prefix): quantises the block in place
    rest_device: torch.device = torch.device("cpu")  # where the rest is filled (random:full draws by device)


@dataclass(frozen=True)
class QuantisedStore:
    directory: Path
    revision: str  # the weights quantised (ModelSource.revision)
    dtype: torch.dtype  # of the rest of the model (the blocks are quantised from this dtype)
    layout: Layout

    def path(self, partition: str) -> Path:
        """The partition's directory: a file per block group (`Layout.group_of`)."""
        import torchao

        identity = "|".join(
            (self.revision, partition, str(self.dtype), self.layout.recipe, torch.__version__, torchao.__version__)
        )
        return self.directory / f"{partition}-{self.layout.kind}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"

    def load(self, partition: str, skeleton: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
        """`skeleton()` (the partition on the meta device) with its saved weights assigned (memory-mapped host
        tensors), or None if none are saved."""
        path, kind = self.path(partition), self.layout.kind
        if not (path / f"{REST}.pt").is_file():
            log.info("%s: no %s weights saved in %s: quantising, then saving them", partition, kind, self.directory)
            return None
        started = time.perf_counter()
        try:
            state: dict[str, torch.Tensor] = {}
            for file in sorted(path.glob("*.pt")):
                state.update(torch.load(file, map_location="cpu", mmap=True, weights_only=True))
            model = skeleton().requires_grad_(False)
            model.load_state_dict(state, strict=True, assign=True)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the files, quantising again is the way on
            log.warning("%s: %s does not load (%s): deleted, quantising again", partition, path, describe(exc, lines=1))
            shutil.rmtree(path, ignore_errors=True)
            return None
        log.info(
            "%s: %s weights assigned from %s (%.1f GiB) in %.1f s",
            partition,
            kind,
            path,
            _size_gib(path),
            time.perf_counter() - started,
        )
        return model

    def build(self, partition: str, source: Build) -> None:
        """Quantise the partition block by block from `source.weights` into its files: each block of the skeleton is
        filled on `source.device` (a GPU: fast, and no host memory), quantised there, and written by a writer thread
        while the next block is filled. Host memory holds at most two blocks' quantised tensors."""
        model = source.skeleton().requires_grad_(False)
        started = time.perf_counter()
        self._write(partition, _quantised_groups(model, self.layout.blocks, source), "block by block")
        if source.device.type == "cuda":
            torch.cuda.empty_cache()  # the blocks passed through the allocator's cache: the card is shared
        log.info("%s: quantised from %s in %.1f s", partition, source.weights.label, time.perf_counter() - started)

    def load_or_build(self, partition: str, source: Build) -> torch.nn.Module | None:
        """The partition from the store, quantised into it block by block first (`build`) if it is not saved yet;
        None when it could not be saved (the warning before it says why)."""
        model = self.load(partition, source.skeleton)
        if model is None:
            self.build(partition, source)
            model = self.load(partition, source.skeleton)
        return model

    def save(self, partition: str, model: torch.nn.Module) -> None:
        """Save the quantised partition under its key, now."""
        self._write(partition, self._groups(model.state_dict()))

    def save_later(self, partition: str, model: torch.nn.Module) -> threading.Thread:
        """Save the partition's weights as they are now on a thread of their own (`wait_for_saves` joins it). Only
        for weights nothing changes afterwards: the served ones, not a copy that sharding replaces. Copies from a
        GPU run on a side stream, after what the current stream has queued (the quantisation), beside requests."""
        state, kind = model.state_dict(), self.layout.kind
        gpu = next((tensor.device for tensor in state.values() if tensor.device.type == "cuda"), None)
        side = torch.cuda.Stream(gpu) if gpu else None  # torch.cuda.stream(None) changes nothing
        if side:
            side.wait_stream(torch.cuda.current_stream(gpu))

        def write() -> None:
            with torch.cuda.stream(side):
                try:
                    self._write(partition, self._groups(state), "in the background")
                except Exception:  # noqa: BLE001 - a thread's failure would otherwise only reach stderr
                    log.exception("%s: %s weights not saved: the next start quantises again", partition, kind)

        thread = threading.Thread(target=write, name=f"{kind}-save-{partition}", daemon=True)
        _saves.append(thread)
        thread.start()
        return thread

    def _groups(self, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """A whole state dict, group by group (`Layout.group_of`)."""
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            grouped.setdefault(self.layout.group_of(name), {})[name] = tensor
        yield from grouped.items()

    def _write(self, partition: str, groups: Iterator[tuple[str, dict[str, torch.Tensor]]], how: str = "") -> None:
        """Each group's file written into a directory aside, renamed into place when all are; a failure to write
        is a warning (the directory itself may be what failed), any other failure goes to the caller."""
        path, kind = self.path(partition), self.layout.kind
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        started = time.perf_counter()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _drop_stale_partials(path)
            partial.mkdir()
            with ThreadPoolExecutor(1, thread_name_prefix=f"{kind}-write") as writer:
                pending: Future | None = None
                for name, state in groups:
                    if pending is not None:
                        pending.result()  # one group written while the next is made: two in host memory at most
                    pending = writer.submit(torch.save, state, partial / f"{name}.pt")
                if pending is not None:
                    pending.result()
            os.replace(partial, path)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            log.warning(
                "%s: %s weights not saved to %s (%s): the next start quantises again",
                partition,
                kind,
                path,
                describe(exc, lines=1),
            )
            return
        log.info(
            "%s: %s weights saved to %s (%.1f GiB) in %.1f s%s",
            partition,
            kind,
            path,
            _size_gib(path),
            time.perf_counter() - started,
            f" {how}" if how else "",
        )


def _quantised_groups(model: torch.nn.Module, blocks_name: str, source: Build) -> Iterator[tuple[str, dict]]:
    """The skeleton's block groups, each filled on the source's device, quantised there and handed over on the CPU,
    then the rest (filled on its `rest_device`: nothing in it is quantised)."""
    blocks = cast(torch.nn.ModuleList, model.get_submodule(blocks_name))
    for index in range(len(blocks)):  # by index: enumerate's reused tuple would keep the last block referenced
        block, prefix = blocks[index], f"{blocks_name}.{index}."
        sharded_load.fill_module(block, source.weights, prefix, source.device)
        source.quantize(block, prefix)
        yield f"{blocks_name}.{index}", {prefix + name: t.cpu() for name, t in block.state_dict().items()}
        blocks[index] = torch.nn.Identity()  # the device copy goes; the CPU one goes with the writer
        # torchao's quantised weights sit in reference cycles, which only the cyclic collector frees, and it seldom
        # runs here (few Python objects are made): on one H200 the uncollected blocks filled a 14 GiB cap by the
        # eleventh block. Collected block by block, the device holds about one block.
        del block
        gc.collect()
    sharded_load.fill_module(model, source.weights, "", source.rest_device)  # nothing in the rest is quantised
    yield REST, {name: tensor.cpu() for name, tensor in model.state_dict().items()}


def _size_gib(path: Path) -> float:
    return sum(file.stat().st_size for file in path.glob("*.pt")) / 2**30


_saves: list[threading.Thread] = []  # save_later's threads, also finished ones (a few per process)


def wait_for_saves(timeout_s: float | None = None) -> bool:
    """Join every background save of this process; True when none is still writing."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for thread in _saves:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in _saves)


def before_serving(when: str, announce: Callable[[str], None]) -> None:
    """`[dit] fp8_save`: with "before_serving", wait until this process's background saves are written, after saying
    so through `announce` (the DiT's state while it starts); with "background", or nothing being written, go on."""
    writing = [thread for thread in _saves if thread.is_alive()]
    if when != "before_serving" or not writing:
        return
    announce("writing the fp8 weights before SERVING ([dit] fp8_save)")
    started = time.perf_counter()
    wait_for_saves()
    log.info("fp8 weights written: SERVING %.1f s later than without the wait", time.perf_counter() - started)


def saves_in_flight(directory: Path) -> list[Path]:
    """What saves of running processes are writing in `directory`."""
    return [partial for partial in directory.glob("*.partial-*") if _writer_running(partial)]


def _drop_stale_partials(path: Path) -> None:
    """Delete what saves of `path` by processes no longer running left behind (a start killed while saving)."""
    for partial in path.parent.glob(f"{path.name}.partial-*"):
        if not _writer_running(partial):
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.unlink(missing_ok=True)


def _writer_running(partial: Path) -> bool:
    pid = partial.name.rpartition("-")[2]
    return not pid.isdigit() or _running(int(pid))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
