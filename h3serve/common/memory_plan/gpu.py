"""Each GPU's predicted peak: every model process placed on the GPUs its `gpus` names, weights + onloaded parts +
activations + overhead, added up (or the busiest turn when stages take turns); the request planned for is the
largest that admission lets through. The calibrations (measured peaks, estimates): docs/memory-plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from h3serve.common.config import (
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
    is_gguf,
    on_gpu,
)
from h3serve.common.memory_plan.host import HostPlan, host_plan
from h3serve.model import rules, workflows

DIT_ACT_FIXED_GIB = 0.1
DIT_ACT_PER_ROW_GIB = 1.75e-4
DIT_SPLIT_FACTOR = 1.3
ENCODER_ACT_FIXED_GIB = 0.25
ENCODER_ACT_PER_TOKEN_BYTES = (52 * 5120 + 3 * 25_600) * 2
VAE_ACT_FIXED_GIB = 2.6
VAE_ACT_PER_TILE_GIB = 0.104
CONTEXT_GIB = 0.5
NCCL_GIB = 0.25
FRAGMENTATION = 0.05
DEFAULT_TEXT_ROWS = 256
# linear_precision = "fp16_scaled": the residual stream in fp32 (fp16_linears.py); an ESTIMATE, not measured: of the
# ~188 KB a row the bf16 path holds, ~64 KB are stream-wide (5,376) tensors, which double; the FFN's wide ones stay
# bf16. bench/turing_linears.py prints the measured peaks at 480x832x124 to check it against
FP16_SCALED_ACT_FACTOR = 1.4
# attention_backend = "sage": its int8 Q and K copies and fp16 V, per element of q/k/v (56 heads x 128 per row), and
# Q's and K's fp32 scales, one per row and head
SAGE_WORKSPACE_BYTES_PER_ROW = (2 * 1 + 2) * 56 * 128 + 2 * 4 * 56
# fp8 = true without compile: torchao quantises each linear's input with eager kernels, which hold |x| in bf16 and an
# fp32 copy of the widest input, the FFN's inner activations (14,336 a row); compile fuses them away. CALIBRATED on
# the 24 GB profile (eager fp8, native attention) on one H200, 2026-12-04: its DiT peaked at 14.1 GiB at 768x1344x124
# where the bf16 line alone plans 11.4 (docs/memory-plan.md "Planned against measured")
FP8_EAGER_BYTES_PER_ROW = (2 + 4) * 14_336


def limit_fraction(limit_gib: float, total_bytes: int) -> float:
    """The allocator fraction `memory_limit_gib` asks of a card of `total_bytes`; ValueError (naming both) when the
    limit is above the card. h3serve/runtime/memory.py applies it at start; the plan checks it against --gpu-gib."""
    if limit_gib <= 0:
        raise ValueError(f"memory_limit_gib must be positive to cap the allocator, got {limit_gib:g}")
    limit = limit_gib * GIB
    if limit > total_bytes:
        raise ValueError(
            f"memory_limit_gib = {limit_gib:g} GiB is above the card's total of "
            f"{total_bytes / GIB:.2f} GiB ({total_bytes:,} bytes); lower it, or 0 for the whole card"
        )
    return limit / total_bytes


@dataclass(frozen=True)
class Workload:
    """The largest request planned for: its canvas, frames and packed rows, and what bounded the rows."""

    height: int
    width: int
    frames: int
    rows: int  # packed DiT rows: text + conditioning + generated video and audio
    bound: str  # where `rows` comes from

    @property
    def pixels_frames(self) -> int:
        return self.height * self.width * self.frames


@dataclass(frozen=True)
class Share:
    """One process's part of one GPU, in GiB."""

    gpu: str
    process: str  # "dit rank 0", "encoder", "vae"
    weights: float  # resident weights (a shard under FSDP; a part under spread)
    transient: float  # gathered FSDP units, onloaded blocks or layers
    activations: float
    limit: float  # the process's memory_limit_gib (0: none)
    host: float = 0.0  # weights this process keeps in host memory (offload)
    nccl: float = 0.0

    @property
    def allocator(self) -> float:
        """Peak of the caching allocator with fragmentation: what `memory_limit_gib` caps."""
        return (self.weights + self.transient + self.activations) * (1 + FRAGMENTATION)

    @property
    def total(self) -> float:
        return self.allocator + CONTEXT_GIB + self.nccl

    @property
    def idle(self) -> float:
        """Between its requests: its resident weights (the allocator's cache handed back) and context."""
        return self.weights + CONTEXT_GIB + self.nccl

    def parts(self) -> str:
        parts = [f"weights {self.weights:.1f}"]
        if self.transient:
            parts.append(f"onloaded {self.transient:.1f}")
        parts += [
            f"activations {self.activations:.1f}",
            f"overhead {self.total - self.weights - self.transient - self.activations:.1f}",
        ]
        return ", ".join(parts)

    def describe(self) -> str:
        cap = f", cap {self.limit:g}" if self.limit else ""
        host = f", host {self.host:.1f}" if self.host else ""
        return f"{self.process:<12} {self.total:5.1f} GiB ({self.parts()}{cap}{host})"


@dataclass(frozen=True)
class GpuPlan:
    gpu: str
    card: float | None  # GiB; None: unknown
    card_source: str
    shares: tuple[Share, ...]
    turns: bool = False  # [gateway] stages_take_turns: one process at its peak at a time

    @property
    def used(self) -> float:
        return max(self._turn(busy) for busy in self.shares) if self.turns else sum(s.total for s in self.shares)

    def breakdown(self) -> str:
        """What `used` adds up: every process at its peak, or the busiest turn's."""
        if not self.turns:
            return " + ".join(f"{share.process} {share.total:.1f}" for share in self.shares)
        busy = max(self.shares, key=self._turn)
        return " + ".join(
            f"{s.process} {s.total:.1f}" if s is busy else f"{s.process} idle {s.idle:.1f}" for s in self.shares
        )

    def _turn(self, busy: Share) -> float:
        return busy.total + sum(share.idle for share in self.shares if share is not busy)


@dataclass(frozen=True)
class Plan:
    workload: Workload
    gpus: tuple[GpuPlan, ...]
    host: HostPlan
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def lines(self) -> list[str]:
        w = self.workload
        out = [f"largest request: {w.height}x{w.width}, {w.frames} frames: {w.rows:,} packed rows ({w.bound})"]
        for gpu in self.gpus:
            card = f"card {gpu.card:g} GiB ({gpu.card_source})" if gpu.card else "card size unknown"
            free = f", {gpu.card - gpu.used:.1f} free" if gpu.card else ""
            turns = " (stages take turns: the busiest turn)" if gpu.turns else ""
            out.append(f"GPU {gpu.gpu}: {gpu.used:.1f} GiB predicted{turns}, {card}{free}")
            out += [f"  {share.describe()}" for share in gpu.shares]
        out += self.host.lines()
        out += [f"note: {note}" for note in self.notes]
        out.append("fits" if not self.problems else f"does not fit: {len(self.problems)} problem(s)")
        return out


def _listed(gpus: str) -> list[str]:
    return [gpu.strip() for gpu in gpus.split(",") if gpu.strip()]


def _device_gpus(service: ModelServiceConfig, count: int, notes: list[str], name: str) -> list[str]:
    """The GPUs (as CUDA_VISIBLE_DEVICES names them) of `count` devices of a process, from the device index on."""
    listed = _listed(service.gpus)
    if not listed:
        listed = [str(i) for i in range(max(count, 1))]
        notes.append(f"[{name}] gpus is empty (inherits CUDA_VISIBLE_DEVICES): planned as GPU(s) {','.join(listed)}")
    _, _, index = service.device.partition(":")
    start = int(index) if index.isdigit() else 0
    return listed[start : start + count]


def workload(
    config: DeployConfig,
    canvas: tuple[int, int] | None = None,
    frames: int | None = None,
    text_rows: int = DEFAULT_TEXT_ROWS,
) -> Workload:
    """The request to plan for (docs/memory-plan.md): by default the largest canvas at the longest clip, bounded by
    admission."""
    height, width = canvas or config.gateway.geometry.default_canvas
    longest = frames or rules.VALID_NUM_FRAMES[-1]
    served = [workflows.by_name(name) for name in config.dit.workflows]
    condition = 2 * rules.rows_per_latent_frame(height, width) if any(f.name == "fl2va" for f in served) else 0
    generated = rules.generated_rows(height, width, longest)
    rows, bound = (
        text_rows + condition + generated.total,
        (f"{text_rows} text + {condition} keyframe + {generated.video:,} video + {generated.audio} audio rows"),
    )
    limits = {"[gateway] max_rows": config.gateway.max_rows, "[dit] max_rows": config.dit.max_rows}
    tables = [config.gateway.capacity.get(f.name, {}) for f in served]
    per_flow = [table.get(f"{height}x{width}", table.get("*")) for table in tables]
    bounded = [limit for limit in per_flow if limit is not None]
    if len(bounded) == len(per_flow):  # a workflow with no entry is not limited
        limits[f"[gateway] capacity for {height}x{width}"] = max(bounded)
    source = min(limits, key=limits.__getitem__)
    if frames is None and limits[source] < rows:
        rows = limits[source]
        fitting = [
            f
            for f in rules.VALID_NUM_FRAMES
            if text_rows + condition + rules.generated_rows(height, width, f).total <= rows
        ]
        longest = fitting[-1] if fitting else 0
        bound = f"bounded by {source}; {longest} frames fit it" + (
            "" if fitting else f": every {height}x{width} request is refused (--canvas plans another canvas)"
        )
    return Workload(height, width, longest, rows, bound)


def _dit_shares(dit: DiTConfig, work: Workload, notes: list[str]) -> list[Share]:
    world, per_node = dit.world_size, dit.world_size // dit.nnodes
    partitions = sorted({workflows.by_name(name).partition for name in dit.workflows})
    count = len(partitions)
    total, block = (gib(nbytes) for nbytes in dit_weights(dit))
    fsdp = dit.fsdp and world > 1
    if is_gguf(dit) and gguf_bytes(dit) is None:
        notes.append(f"[dit] transformer_file {dit.transformer_file!r} is not here: its partition counted in bf16")
    if dit.offload == "group":
        # one partition runs at a time: its outside-the-blocks group and two blocks are on the GPU
        weights, transient, host = 0.0, gib(TRANSFORMER.outside_blocks_bytes(dit.dtype)) + 2 * block, total
    elif fsdp:
        transient = gib(TRANSFORMER.fsdp_root_bytes(dit.dtype)) + 2 * block
        weights, host = (0.0, total / world) if dit.fsdp_offload else (total / world, 0.0)
    else:
        weights, transient, host = total, 0.0, 0.0
    rows = math.ceil(work.rows / world)
    activations = DIT_ACT_FIXED_GIB + DIT_ACT_PER_ROW_GIB * rows * (DIT_SPLIT_FACTOR if world > 1 else 1.0)
    activations *= FP16_SCALED_ACT_FACTOR if dit.linear_precision == "fp16_scaled" else 1.0
    if dit.fp8 and not dit.compile:
        activations += gib(FP8_EAGER_BYTES_PER_ROW * rows)
    if dit.attention_backend == "sage":  # Ulysses: a rank attends all rows over its heads, the same bytes
        activations += gib(SAGE_WORKSPACE_BYTES_PER_ROW * rows)
    if dit.weights == "int8":  # one int8 weight widened to fp16 at a time
        transient += gib(TRANSFORMER.largest_linear * DTYPE_BYTES["float16"])
    adapters = sum(file_gib(source.path) for source in dit.adapters.values())
    weights += adapters / world if fsdp else adapters
    if count > 1:
        notes.append(f"[dit] workflows {list(dit.workflows)} load {count} partitions ({', '.join(partitions)})")
    if dit.nnodes > 1:
        notes.append(f"[dit] nnodes = {dit.nnodes}: the GPUs shown are one node's; every node holds the same")
    gpus = _device_gpus(dit, per_node, notes, "dit") if on_gpu(dit) else []
    if on_gpu(dit) and len(gpus) < per_node:
        notes.append(f"[dit] {per_node} ranks per node but gpus = {dit.gpus!r} names {len(gpus)}")
    nccl = NCCL_GIB if world > 1 else 0.0
    return [
        Share(gpu, f"dit rank {rank}", weights, transient, activations, dit.memory_limit_gib, host, nccl)
        for rank, gpu in enumerate(gpus)
    ]


def _encoder_shares(encoder: EncoderConfig, notes: list[str]) -> list[Share]:
    if not on_gpu(encoder):
        return []
    listed = _listed(encoder.gpus)
    gpus = _device_gpus(encoder, len(listed) if encoder.spread and listed else 1, notes, "encoder")
    full = gib(TEXT_ENCODER.bytes(encoder.dtype, encoder.quantize))
    activations = ENCODER_ACT_FIXED_GIB + gib(ENCODER_ACT_PER_TOKEN_BYTES * encoder.max_prompt_tokens)
    if encoder.cpu_offload:
        weights, transient, host = 0.0, gib(TEXT_ENCODER.offloaded_bytes(encoder.dtype, encoder.quantize)), full
    else:
        weights, transient, host = full / len(gpus), 0.0, 0.0
    return [
        Share(gpu, "encoder", weights, transient, activations, encoder.memory_limit_gib, host if i == 0 else 0.0)
        for i, gpu in enumerate(gpus)
    ]


def _vae_shares(vae: VaeConfig, work: Workload, notes: list[str]) -> list[Share]:
    if not on_gpu(vae):
        return []
    weights = gib(VIDEO_VAE.bytes(vae.dtype, vae.fp8) + AUDIO_VAE.bytes(vae.dtype))
    frames = gib(2 * work.pixels_frames * 3 * 4)  # held on the first GPU only: replicas send their tiles there
    tiles = VAE_ACT_FIXED_GIB + VAE_ACT_PER_TILE_GIB * (vae.tile_batch - 1)
    gpus = _device_gpus(vae, vae.decode_gpus, notes, "vae")
    if not gpus:
        return []
    # offload = "idle": the weights onloaded for each request, in host memory between them
    first = (
        Share(gpus[0], "vae", 0.0, weights, tiles + frames, vae.memory_limit_gib, host=weights)
        if vae.offload == "idle"
        else Share(gpus[0], "vae", weights, 0.0, tiles + frames, vae.memory_limit_gib)
    )
    # A decode replica holds the video VAE without its encoder; planned as the whole video VAE (a little more).
    return [first] + [
        Share(gpu, "vae decode replica", gib(VIDEO_VAE.bytes(vae.dtype, vae.fp8)), 0.0, tiles, vae.memory_limit_gib)
        for gpu in gpus[1:]
    ]


def card_size(config: DeployConfig, limits: Iterable[float]) -> tuple[float | None, str]:
    """A GPU's size in GiB and where it comes from, when no --gpu-gib is given: `[supervisor] gpu_memory_gib`, else
    the largest of the `memory_limit_gib` caps of the processes on it; None when neither is set."""
    if config.supervisor.gpu_memory_gib:
        return config.supervisor.gpu_memory_gib, "[supervisor] gpu_memory_gib"
    caps = [limit for limit in limits if limit]
    return (max(caps), "memory_limit_gib") if caps else (None, "")


def plan(
    config: DeployConfig,
    gpu_gib: float | None = None,
    canvas: tuple[int, int] | None = None,
    frames: int | None = None,
    text_rows: int = DEFAULT_TEXT_ROWS,
    host_gib: float | None = None,
    host_source: str = "--host-gib",
) -> Plan:
    """Every GPU's predicted memory for a deployment (h3serve.common.config.DeployConfig), its host memory, and what
    does not fit.

    A GPU's card is `gpu_gib` when given, else `[supervisor] gpu_memory_gib`, else the largest `memory_limit_gib` of
    the processes on it. The host is
    `host_gib` (from `host_source`), else `[supervisor] host_memory_gib`; None and 0: unknown, not checked (the
    CLI reads the machine's MemTotal)."""
    notes: list[str] = []
    work = workload(config, canvas, frames, text_rows)
    shares = [
        *_dit_shares(config.dit, work, notes),
        *_encoder_shares(config.encoder, notes),
        *_vae_shares(config.vae, work, notes),
    ]
    problems: list[str] = []
    gpus = []
    for gpu in sorted(dict.fromkeys(share.gpu for share in shares), key=lambda g: (not g.isdigit(), g.zfill(8))):
        here = tuple(share for share in shares if share.gpu == gpu)
        limits = [share.limit for share in here if share.limit]
        card, source = (gpu_gib, "--gpu-gib") if gpu_gib else card_size(config, limits)
        gpus.append(GpuPlan(gpu, card, source, here, config.gateway.stages_take_turns))
        if card is None:
            problems.append(
                f"GPU {gpu}: card size unknown ({', '.join(s.process for s in here)}): "
                "give --gpu-gib or memory_limit_gib"
            )
            continue
        for share in here:
            if share.limit and share.allocator > share.limit:
                problems.append(
                    f"GPU {gpu}: {share.process} needs {share.allocator:.1f} GiB of allocator (weights "
                    f"{share.weights:.1f} + onloaded {share.transient:.1f} + activations "
                    f"{share.activations:.1f}, +{FRAGMENTATION:.0%} fragmentation), over its "
                    f"memory_limit_gib {share.limit:g}"
                )
            if gpu_gib and share.limit:
                try:
                    limit_fraction(share.limit, int(gpu_gib * GIB))
                except ValueError as exc:
                    problems.append(f"GPU {gpu}: {share.process}: {exc}")
        capped = sum(share.limit + CONTEXT_GIB + share.nccl for share in here if share.limit)
        if len(limits) > 1 and capped > card:
            notes.append(
                f"GPU {gpu}: the memory_limit_gib caps of its processes add up to {capped:.1f} GiB with their CUDA "
                f"contexts, over the card's {card:g} GiB: a process's cached memory can crowd out another's; "
                "give each process its share (docs/deploy/single-32gb.toml)"
            )
        if gpus[-1].used > card:
            problems.append(
                f"GPU {gpu}: {gpus[-1].breakdown()} = {gpus[-1].used:.1f} GiB predicted, over the card's {card:g} GiB "
                f"({source})"
            )
    if not shares:
        notes.append('no model service is on a GPU (device = "cpu"): nothing to place')
    if host_gib is None and config.supervisor.host_memory_gib:
        host_gib, host_source = config.supervisor.host_memory_gib, "[supervisor] host_memory_gib"
    host = host_plan(config, host_gib or None, host_source)
    problems += host.problems(config)
    return Plan(work, tuple(gpus), host, tuple(problems), tuple(notes))


# Host memory (docs/memory-plan.md): each process's private peak at start and while serving.
