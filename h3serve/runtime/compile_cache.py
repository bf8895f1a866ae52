"""Compiled graphs on disk, so a restart loads them instead of compiling, and the counts Info reports.

torch.compile keeps Inductor's compiled graphs (FX graph and AOTAutograd caches) and Triton's kernels in cache
directories, by default under /tmp, which a reboot or a fresh container loses. `compile_cache_dir` puts them where
the deployment keeps its state; a DiT group's self-healing restart and a service restart then trace the model
again but load every graph it compiled before (tests/test_warmup.py: every graph of a restart came from the cache).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("h3serve.compile_cache")
ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use(directory: str) -> None:
    """Point this process's Inductor and Triton caches into `directory` (before anything compiles)."""
    for variable, name in ENV.items():
        path = Path(directory) / name
        path.mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(path)
    log.info("compile caches in %s", directory)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled (or loaded) in this process (DiTInfo.compiled_graphs)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cache_hits() -> int:
    """Inductor graphs loaded from the cache instead of compiled, in this process (DiTInfo.compile_cache_hits)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]
