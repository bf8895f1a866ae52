"""Compiled graphs on disk, so a restart loads them instead of compiling, and the counts Info reports.

torch.compile keeps Inductor's compiled graphs (FX graph and AOTAutograd caches) and Triton's kernels in cache
directories, by default under /tmp, which a reboot or a fresh container loses. `compile_cache_dir` puts them where
the deployment keeps its state; a DiT group's self-healing restart and a service restart then trace the model
again but load every graph it compiled before (tests/test_warmup.py: every graph of a restart came from the cache).

torch writes each cache file under a temporary name and renames it, so a process killed mid-write leaves no torn
file; but a rename that no fsync made durable can leave a truncated or empty file after a power loss, and a torn
file fails every compile that reads it (Inductor raises on the cut generated module instead of compiling again).
`set_aside_if_damaged` recognises that failure by the cache's own path in it and moves the directory aside, so the
restart that follows compiles into an empty one instead of failing the same way until its restarts run out. A full
disk names the cache too, but the cache is whole: it stays.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from h3serve.common import disk

log = logging.getLogger("h3serve.compile_cache")
ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
_in_use = ""  # the directory `use` pointed this process's caches into


def use(directory: str) -> None:
    """Point this process's Inductor and Triton caches into `directory` (before anything compiles)."""
    global _in_use
    _in_use = str(directory)
    for variable, name in ENV.items():
        path = Path(directory) / name
        path.mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(path)
    log.info("compile caches in %s", directory)


def set_aside_if_damaged(exc: BaseException) -> str:
    """If `exc` came from reading a file of this process's compile cache, move the cache aside (kept, renamed
    `<dir>.damaged-<UTC time>`, for a look at what tore it) and say so; else "" and nothing moves."""
    directory = _in_use
    if not directory or any(disk.is_full(cause) for cause in _chain(exc)):
        return ""
    if directory + os.sep not in "".join(traceback.format_exception(exc)):
        return ""
    aside = f"{directory}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    try:
        os.rename(directory, aside)
    except FileNotFoundError:  # another rank of the group set it aside first
        return f"the compile cache {directory} could not be read (set aside by another rank)"
    log.error("the compile cache %s could not be read: moved to %s; the next start compiles afresh", directory, aside)
    return f"the compile cache {directory} could not be read: moved to {aside}, the next start compiles afresh"


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled (or loaded) in this process (DiTInfo.compiled_graphs)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cache_hits() -> int:
    """Inductor graphs loaded from the cache instead of compiled, in this process (DiTInfo.compile_cache_hits)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def time_report(least_s: float = 0.5) -> str:
    """Where this process's compile time went (torch's own timers, longest first, those of `least_s` or more) and
    what its caches served: the line a start logs after its warm-up."""
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    # torch's csv overload types the values as object; they are the str its implementation returns
    timers = sorted(((float(str(value)), name) for name, value in zip(names, values, strict=True)), reverse=True)
    spent = ", ".join(f"{name} {seconds:.1f} s" for seconds, name in timers if seconds >= least_s) or "none"
    caches = "; ".join(
        f"{kind} " + ", ".join(f"{key} {count}" for key, count in sorted(counters[kind].items()) if "cache" in key)
        for kind in ("aot_autograd", "inductor")
    )
    return f"compile time: {spent}; caches: {caches}"
