"""Each process's PRIVATE host memory (RssAnon + RssShmem: what the OOM killer counts) at start and serving, and the
host check a service runs at its own start; mapped file pages apart (page cache). Sources: docs/memory-plan.md.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

from h3serve.common.config import (
    SERVICES,
    DeployConfig,
    DiTConfig,
    EncoderConfig,
    ModelServiceConfig,
    VaeConfig,
)
from h3serve.common.memory_plan.counts import (
    AUDIO_VAE,
    DTYPE_BYTES,
    GIB,
    TEXT_ENCODER,
    TRANSFORMER,
    VIDEO_VAE,
    dit_weights,
    file_gib,
    gguf_bytes,
    gib,
    on_gpu,
)
from h3serve.model import workflows

PROCESS_BASE_GIB = 5.0  # a model process on CUDA: calibrated (docs/memory-plan.md)
CPU_PROCESS_BASE_GIB = 0.6  # a model process on the CPU: measured, the tiny stack
GATEWAY_GIB = 0.3
LAUNCHER_GIB = 0.05
HOST_RESERVE_GIB = 4.0  # left to the OS, page tables and whatever else the host runs
ARENA_GIB = 1  # h3serve/runtime/pinned.py ARENA_BYTES (tests/test_host_plan.py checks they agree)
STAGING_SLOTS = 2  # h3serve/runtime/weight_stream.py's (the same check)
SMALL_MODEL_GIB = 1.0  # a model directory with fewer GiB of weights is not the released model
# h3serve/runtime/quantised_store.py build: blocks' quantised tensors held for the writer at most
QUANTISED_BUILD_BLOCKS = 2


class HostMemoryError(ValueError):
    """A service whose start needs more host memory than the host has available."""


@dataclass(frozen=True)
class HostNeed:
    """One service's private host memory, in GiB, part by part, in its two phases; its mapped file pages apart."""

    service: str
    start_parts: dict[str, float]
    serving_parts: dict[str, float]
    file_pages: float = 0.0

    @property
    def start(self) -> float:
        return sum(self.start_parts.values())

    @property
    def serving(self) -> float:
        return sum(self.serving_parts.values())

    def phase(self, name: str) -> float:
        return self.start if name == "start" else self.serving

    def parts(self, name: str) -> str:
        parts = self.start_parts if name == "start" else self.serving_parts
        return " + ".join(f"{part} {gib:.1f}" for part, gib in parts.items() if gib)

    def describe(self) -> str:
        files = f" (+{self.file_pages:.1f} GiB file pages)" if self.file_pages else ""
        return f"{self.service:<12} start {self.start:5.1f} GiB, serving {self.serving:5.1f} GiB{files}"


PHASES = ("start", "serving")


def pinned_gib(nbytes: float, large: tuple[float, ...] = ()) -> float:
    """Host memory that pinning `nbytes` takes (h3serve/runtime/pinned.py): whole arenas, and each tensor of `large`
    (already in `nbytes`, each above an arena) on its own, rounded up to a power of two by the pinned allocator."""
    alone = sum(2 ** math.ceil(math.log2(gib(size))) for size in large)
    return math.ceil(gib(nbytes - sum(large)) / ARENA_GIB) * ARENA_GIB + alone


def _runtime(service: ModelServiceConfig) -> float:
    return PROCESS_BASE_GIB if on_gpu(service) else CPU_PROCESS_BASE_GIB


def _tiny(service: ModelServiceConfig) -> bool:
    """The built-in tiny preset, or a model directory whose weights are that small (the tiny preset saved, as the
    tests' stacks load it): megabytes of weights, not the released sizes the plan assumes."""
    return not service.model_dir or _small_directory(service.model_dir)


@functools.cache
def _small_directory(model_dir: str) -> bool:
    if not os.path.isdir(model_dir):
        return False  # not on this machine (a plan for another host), or random:full: the released sizes
    weights = sum(file_gib(str(path)) for path in Path(model_dir).rglob("*.safetensors"))
    return weights < SMALL_MODEL_GIB


def dit_host(dit: DiTConfig) -> HostNeed:
    """The DiT's processes on one node: its launcher and world_size / nnodes ranks."""
    ranks = dit.world_size // dit.nnodes
    runtime = {"launcher": LAUNCHER_GIB, "runtime": ranks * _runtime(dit)}
    adapters = {"adapters": ranks * sum(file_gib(source.path) for source in dit.adapters.values())}
    count = len({workflows.by_name(name).partition for name in dit.workflows})
    weights, block = dit_weights(dit)
    if _tiny(dit):
        return HostNeed("dit", {**runtime, **adapters}, runtime)
    if not on_gpu(dit):
        held = {"weights": ranks * gib(weights)}
        return HostNeed("dit", {**runtime, **held, **adapters}, {**runtime, **held})
    if dit.offload == "group" and dit.fp8_cache_dir:
        staging = {"staging": STAGING_SLOTS * pinned_gib(block, (block,) if block > ARENA_GIB * GIB else ())}
        build = {"fp8 build": QUANTISED_BUILD_BLOCKS * gib(block)}
        return HostNeed("dit", {**runtime, **staging, **adapters, **build}, {**runtime, **staging}, gib(weights))
    if dit.offload == "group":
        pinned = {"pinned weights": pinned_gib(weights)}
        # at start the weights are built in bf16 (fp8 quantises them after); a GGUF is read as it stays, quantised
        gguf = gguf_bytes(dit) is not None
        read = weights if gguf else TRANSFORMER.bytes(dit.dtype, False) * count
        start = {"GGUF read" if gguf else "bf16 build": max(gib(read), pinned["pinned weights"])}
        return HostNeed("dit", {**runtime, **start, **adapters}, {**runtime, **pinned})
    if dit.fsdp and dit.fsdp_offload and dit.world_size > 1:
        shards = {"pinned shards": ranks * gib(weights) / dit.world_size}
        return HostNeed("dit", {**runtime, **shards, **adapters}, {**runtime, **shards})
    return HostNeed("dit", {**runtime, **adapters}, runtime)


def encoder_host(encoder: EncoderConfig, quantize: str | None = None) -> HostNeed:
    """The text encoder's process; `quantize` plans another setting than the configured one."""
    quantize = quantize or encoder.quantize
    runtime = {"runtime": _runtime(encoder)}
    if _tiny(encoder):
        return HostNeed("encoder", runtime, runtime)
    bf16 = gib(TEXT_ENCODER.bytes(encoder.dtype, "none"))
    weights = TEXT_ENCODER.bytes(encoder.dtype, quantize)
    if not on_gpu(encoder):  # loaded whole, then quantised in place
        return HostNeed(
            "encoder", {**runtime, "weights": max(bf16, gib(weights))}, {**runtime, "weights": gib(weights)}
        )
    if encoder.cpu_offload:
        embedding = TEXT_ENCODER.embedding * DTYPE_BYTES[encoder.dtype]
        pinned = {"pinned weights": pinned_gib(weights, (embedding,) if embedding > ARENA_GIB * GIB else ())}
        if quantize != "none":  # built layer by layer on the GPU (placement.layer_weights), or into the int8 store
            layers = QUANTISED_BUILD_BLOCKS if encoder.int8_cache_dir else 1
            layer = {"layers built": layers * gib(TEXT_ENCODER.layer_bytes(encoder.dtype, quantize))}
            return HostNeed("encoder", {**runtime, **pinned, **layer}, {**runtime, **pinned})
        return HostNeed("encoder", {**runtime, "bf16 load": max(bf16, pinned["pinned weights"])}, {**runtime, **pinned})
    if quantize != "none" and encoder.spread:  # built layer by layer on its GPUs (placement.build_spread)
        return HostNeed("encoder", runtime, runtime)
    if quantize != "none" or encoder.spread:  # staged on the CPU, placed from there
        return HostNeed("encoder", {**runtime, "bf16 load": bf16}, runtime)
    return HostNeed("encoder", runtime, runtime)


def vae_host(vae: VaeConfig) -> HostNeed:
    runtime = {"runtime": _runtime(vae)}
    if _tiny(vae) or (on_gpu(vae) and vae.offload == "none"):
        return HostNeed("vae", runtime, runtime)
    weights = gib(VIDEO_VAE.bytes(vae.dtype) + AUDIO_VAE.bytes(vae.dtype))
    held = {"pinned weights": pinned_gib(weights * GIB)} if on_gpu(vae) else {"weights": weights}
    return HostNeed("vae", {**runtime, **held}, {**runtime, **held})


def host_need(section: ModelServiceConfig) -> HostNeed:
    """The host memory of the model service that `section` configures."""
    if isinstance(section, DiTConfig):
        return dit_host(section)
    if isinstance(section, EncoderConfig):
        return encoder_host(section)
    if isinstance(section, VaeConfig):
        return vae_host(section)
    raise TypeError(f"not a model service's section: {type(section).__name__}")


@dataclass(frozen=True)
class HostPlan:
    needs: tuple[HostNeed, ...]  # every process of the deployment, the gateway last
    size: float | None  # GiB; None: unknown
    source: str

    def total(self, phase: str) -> float:
        return sum(need.phase(phase) for need in self.needs)

    @property
    def usable(self) -> float | None:
        return None if self.size is None else self.size - HOST_RESERVE_GIB

    def lines(self) -> list[str]:
        size = (
            f"host {self.size:.1f} GiB ({self.source}), {self.usable:.1f} usable after {HOST_RESERVE_GIB:g} for the OS"
            if self.size is not None
            else "host size unknown"
        )
        files = sum(need.file_pages for need in self.needs)
        out = [f"host memory, private (file pages: page cache, reclaimable): {size}"]
        out += [f"  {need.describe()}" for need in self.needs]
        out.append(
            f"  {'total':<12} start {self.total('start'):5.1f} GiB, serving {self.total('serving'):5.1f} GiB"
            + (f" (+{files:.1f} GiB file pages)" if files else "")
        )
        return out

    def problems(self, config: DeployConfig) -> list[str]:
        if self.usable is None:
            return []
        problems = []
        for phase in PHASES:
            if self.total(phase) > self.usable:
                largest = max(self.needs, key=lambda need: need.phase(phase))
                parts = " + ".join(f"{need.service} {need.phase(phase):.1f}" for need in self.needs)
                problems.append(
                    f"host: {phase}: {parts} = {self.total(phase):.1f} GiB of private host memory, over "
                    f"the host's {self.size:.1f} GiB ({self.source}) less {HOST_RESERVE_GIB:g} for the "
                    f"OS; largest: {largest.service} at {phase}, {largest.phase(phase):.1f} GiB "
                    f"({largest.parts(phase)})"
                )
        if problems:
            problems += _int8_proposal(config, self)
        return problems


def _int8_proposal(config: DeployConfig, host: HostPlan) -> list[str]:
    """Where the encoder's bf16 weights in host memory are what does not fit and its int8 ones would."""
    encoder = config.encoder
    if not (encoder.cpu_offload and encoder.quantize == "none" and on_gpu(encoder)) or _tiny(encoder):
        return []
    int8, current = encoder_host(encoder, "int8"), next(need for need in host.needs if need.service == "encoder")
    others = [need for need in host.needs if need is not current]
    usable = host.usable
    assert usable is not None  # problems() proposes only against a known host size
    if any(sum(need.phase(phase) for need in others) + int8.phase(phase) > usable for phase in PHASES):
        return []
    return [
        f'host: [encoder] quantize = "int8" would fit: {int8.serving_parts["pinned weights"]:.0f} GiB of '
        f"int8 weights pinned instead of {current.serving_parts['pinned weights']:.0f} of "
        f"{encoder.dtype} (start {int8.start:.1f} GiB, serving {int8.serving:.1f}; it changes the embeddings "
        "within the documented bound, h3serve/services/encoder/placement.py)"
    ]


def host_plan(config: DeployConfig, size: float | None, source: str) -> HostPlan:
    needs = [host_need(config.service(name)) for name in SERVICES]
    gateway = {"runtime": GATEWAY_GIB}
    return HostPlan((*needs, HostNeed("gateway", gateway, gateway)), size, source)


def check_host(service: str, section: ModelServiceConfig, available_gib: float) -> HostNeed:
    """A model service's own check at its start, before it loads anything: its start peak against the host's
    MemAvailable now (the other services may be starting too: this sees only what they hold already).
    HostMemoryError (a ValueError) names the service, the phase and the numbers."""
    need = host_need(section)
    if need.start > available_gib:
        raise HostMemoryError(
            f"host memory: {service} needs {need.start:.1f} GiB of private host memory at start "
            f"({need.parts('start')}), but the host has {available_gib:.1f} GiB available (MemAvailable); "
            f"`h3serve plan` shows every service's part (docs/deploy/host-memory.md)"
        )
    return need
