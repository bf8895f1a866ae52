"""Start-up shared by the model services: logging, threads, device, components, ModelInfo."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from h3serve.common import logs, memory_plan
from h3serve.common.config import ModelServiceConfig
from h3serve.common.processes import GIB, MEMINFO, read_meminfo
from h3serve.runtime import compile_cache, memory
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2

log = logging.getLogger("h3serve.runtime")


def warm_up(service: str, run: Callable[[], None]) -> None:
    """Run `run` once before the service opens its port (a process's first model call pays the device's one-time
    set-up, not a user's request), and log what it took."""
    started = time.perf_counter()
    run()
    log.info("%s: warmed up in %.2f s", service, time.perf_counter() - started)
    if torch.cuda.is_initialized():  # the start's GPU peak, which the services sharing a card add up to
        log.info("%s: GPU memory after the warm-up: %s", service, memory.peaks(torch.cuda.current_device()))


def check_host_memory(service: str, config: ModelServiceConfig, meminfo: str = MEMINFO) -> None:
    """Before a model service loads anything: its predicted start peak of private host memory
    (h3serve/common/memory_plan.py) against the host's MemAvailable now, so a host too small refuses with the numbers
    instead of the OOM killer taking a process minutes later. memory_plan.HostMemoryError (a ValueError) when it
    does not fit; nothing is checked where meminfo is unreadable."""
    found = read_meminfo(meminfo)
    if found is None:
        log.warning("%s: %s unreadable: host memory not checked", service, meminfo)
        return
    need = memory_plan.check_host(service, config, found.available / GIB)
    log.info(
        "%s: host memory: %.1f GiB at start predicted, %.1f GiB available", service, need.start, found.available / GIB
    )


def load_model_service(service: str, names: list[str], config: ModelServiceConfig):
    """Load `names` for `service` as configured; returns (components, ModelInfo).

    With `memory_limit_gib` on a CUDA device the process's allocator is capped first (h3serve/runtime/memory.py);
    a limit above the card stops the start here, naming both numbers. Every model process starts here: the
    encoder, the VAE and each DiT rank (on its own device)."""
    logs.setup(service)
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        memory.cap(config, config.device)
    except memory.MemoryLimitError as exc:
        raise SystemExit(f"h3serve serve {service}: memory_limit_gib: {exc}") from None
    if config.compile_cache:
        compile_cache.use(config.compile_cache)
    source = ModelSource(config.model_dir or None)
    started = time.perf_counter()
    components = source.load(names, config.device, config.dtype)
    model = common_pb2.ModelInfo(
        model_revision=source.revision(),
        source=source.label,
        device=config.device,
        dtype=config.dtype,
        components=names,
    )
    log.info(
        "%s: loaded %s from %s (%s) on %s/%s in %.1f s",
        service,
        ", ".join(names),
        source.label,
        model.model_revision,
        config.device,
        config.dtype,
        time.perf_counter() - started,
    )
    return components, model
