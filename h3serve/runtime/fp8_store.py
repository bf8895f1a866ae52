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
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
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
        """Save the quantised partition under its key; written aside and renamed, so a start killed while saving
        leaves no file a later start would take for whole."""
        path = self.path(partition)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        started = time.perf_counter()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _drop_stale_partials(path)
            torch.save(model.state_dict(), partial)
            os.replace(partial, path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # the directory itself may be what failed
                partial.unlink()
            log.warning("%s: fp8 weights not saved to %s (%s): the next start quantises again", partition, path,
                        describe(exc, lines=1))
            return
        log.info("%s: fp8 weights saved to %s (%.1f GiB) in %.1f s", partition, path, path.stat().st_size / 2**30,
                 time.perf_counter() - started)


def _drop_stale_partials(path: Path) -> None:
    """Delete what saves of `path` by processes no longer running left behind (a start killed while saving)."""
    for partial in path.parent.glob(f"{path.name}.partial-*"):
        pid = partial.name.rpartition("-")[2]
        if pid.isdigit() and not _running(int(pid)):
            partial.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
