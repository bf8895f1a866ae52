"""fp8 weights quantised once and loaded at every later start (`[dit] fp8_cache_dir`).

With `fp8 = true` a start loads (or, for `random:full`, builds) the bf16 transformer and then quantises its block
linears: 65.5 s and 42 s of the 32 GB profile's 214.8 s start on one H200 (BENCHMARKS.md). A restart did both again
for the same result. The first start with a cache directory saves each quantised partition's state (`torch.save`:
torchao's fp8 tensors load with `weights_only`); a later start builds the module on the meta device and assigns the
saved tensors, memory-mapped, so the bf16 weights are never read and nothing is quantised again.

The file's key names everything its tensors depend on: the weights (`ModelSource.revision`), the partition, the
dtype, the quantisation recipe and the torch and torchao versions; another of any is another file. A file that does
not load (truncated, or written by an incompatible torchao) is deleted with a warning and the weights quantised and
saved again; a save that fails (a full disk) is a warning too: the cache speeds a start up, it never stops one.

Writing the file took 69.9 s of a 137.5 s cold start on one H200 (44 GiB; README "Warm start"), so a served module's
weights are written in the background (`save_later`) while the start goes on to warm up and serve: the tensors
written are the ones served, which nothing changes, so the save holds no second copy of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from h3serve.common.errors import describe
from h3serve.runtime import random_full

log = logging.getLogger("h3serve.fp8_store")
# what `fastpath.quantize_fp8` does; change it whenever that does, so no start assigns weights quantised otherwise
RECIPE = "torchao Float8DynamicActivationFloat8WeightConfig PerRow on fastpath.fp8_target, v1"


@dataclass(frozen=True)
class Fp8Store:
    directory: Path
    revision: str  # the weights quantised (ModelSource.revision)
    dtype: torch.dtype  # of the rest of the model (fp8 quantises bf16 weights)

    def path(self, partition: str) -> Path:
        import torchao

        identity = "|".join((self.revision, partition, str(self.dtype), RECIPE, torch.__version__, torchao.__version__))
        return self.directory / f"{partition}-fp8-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.pt"

    def load(self, partition: str, factory: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
        """The partition with its saved fp8 weights (memory-mapped host tensors), or None if none is saved."""
        path = self.path(partition)
        if not path.is_file():
            log.info("%s: no fp8 weights saved in %s: quantising, then saving them", partition, self.directory)
            return None
        started = time.perf_counter()
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            model = random_full.skeleton(factory, self.dtype).requires_grad_(False)
            model.load_state_dict(state, strict=True, assign=True)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, quantising again is the way on
            log.warning("%s: %s does not load (%s): deleted, quantising again", partition, path,
                        describe(exc, lines=1))
            path.unlink(missing_ok=True)
            return None
        log.info("%s: fp8 weights assigned from %s (%.1f GiB) in %.1f s", partition, path,
                 path.stat().st_size / 2**30, time.perf_counter() - started)
        return model

    def save(self, partition: str, model: torch.nn.Module) -> None:
        """Save the quantised partition under its key, now."""
        self._write(partition, model.state_dict())

    def save_later(self, partition: str, model: torch.nn.Module) -> threading.Thread:
        """Save the partition's weights as they are now on a thread of their own (`wait_for_saves` joins it). Only
        for weights nothing changes afterwards: the served ones, not a copy that sharding replaces. Copies from a
        GPU run on a side stream, after what the current stream has queued (the quantisation), beside requests."""
        state = model.state_dict()
        gpu = next((tensor.device for tensor in state.values() if tensor.device.type == "cuda"), None)
        side = torch.cuda.Stream(gpu) if gpu else None  # torch.cuda.stream(None) changes nothing
        if side:
            side.wait_stream(torch.cuda.current_stream(gpu))

        def write() -> None:
            with torch.cuda.stream(side):
                try:
                    self._write(partition, state, "in the background")
                except Exception:  # noqa: BLE001 - a thread's failure would otherwise only reach stderr
                    log.exception("%s: fp8 weights not saved: the next start quantises again", partition)

        thread = threading.Thread(target=write, name=f"fp8-save-{partition}", daemon=True)
        _saves.append(thread)
        thread.start()
        return thread

    def _write(self, partition: str, state: dict[str, torch.Tensor], how: str = "") -> None:
        """Written aside and renamed, so a process killed while saving leaves no file a later start would take for
        whole (the next save deletes what it left)."""
        path = self.path(partition)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        started = time.perf_counter()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _drop_stale_partials(path)
            torch.save(state, partial)
            os.replace(partial, path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # the directory itself may be what failed
                partial.unlink()
            log.warning("%s: fp8 weights not saved to %s (%s): the next start quantises again", partition, path,
                        describe(exc, lines=1))
            return
        log.info("%s: fp8 weights saved to %s (%.1f GiB) in %.1f s%s", partition, path, path.stat().st_size / 2**30,
                 time.perf_counter() - started, f" {how}" if how else "")


_saves: list[threading.Thread] = []  # save_later's threads, also finished ones (a few per process)


def wait_for_saves(timeout_s: float | None = None) -> bool:
    """Join every background save of this process; True when none is still writing."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for thread in _saves:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in _saves)


def saves_in_flight(directory: Path) -> list[Path]:
    """The files that saves of running processes are writing in `directory`."""
    return [partial for partial in directory.glob("*.partial-*") if _writer_running(partial)]


def _drop_stale_partials(path: Path) -> None:
    """Delete what saves of `path` by processes no longer running left behind (a start killed while saving)."""
    for partial in path.parent.glob(f"{path.name}.partial-*"):
        if not _writer_running(partial):
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
