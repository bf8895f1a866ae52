"""Predicted GPU memory of a deployment, GPU by GPU, from parameter counts: no torch, nothing loaded.

`plan(config)` places every model process of a deployment file on the GPUs its `gpus` string names
(CUDA_VISIBLE_DEVICES; the DiT's ranks on them in order, one per GPU), predicts each one's peak and adds up
the processes that share a GPU. `h3serve plan` (h3serve/cli/plan.py) prints it and refuses a placement
that cannot fit. Every number is an estimate; where each constant comes from:

- Parameter counts (`TRANSFORMER`, `VIDEO_VAE`, `AUDIO_VAE`, `TEXT_ENCODER`): counted on the meta device
  from diffusers 0.42.1's / transformers' classes at the released sizes, as h3serve/runtime/random_full.py
  builds them (the text encoder is Qwen3-VL-32B with 51 of its 64 decoder layers and no head, as a service
  holds it); tests/test_plan.py counts them again. A model directory with other sizes is not read: the plan
  assumes the released ones.
- Bytes per parameter: the service's dtype, except `_keep_in_fp32_modules` (fp32 always); fp8 stores the
  block linears `fastpath.fp8_target` picks in 1 byte. The encoder quantises its decoder layers' linears only
  (h3serve/services/encoder/placement.py: not the embedding, lm_head or vision tower): int8 in 1 byte; nf4 in
  0.5 byte plus its block statistics, counted as one fp32 absmax per 64 weights (0.5625; bitsandbytes' double
  quantisation stores ~0.516, so this is a bound).
- DiT activations (`DIT_ACT_*`): OUR measurements (BENCHMARKS.md, 1 x H200, bf16, eager, native attention):
  peak 64.4 GiB at 480x832x124 (15,100 packed rows) and 68.3 GiB at 768x1344x124 (37,966 rows), less the
  61.7 GiB of weights: 2.67 and 6.57 GiB, a line of 1.71e-4 GiB per row (rounded up to 1.75e-4) and 0.1 GiB.
  A sequence split over ranks (Ulysses or ring) gives each rank rows / world_size, times `DIT_SPLIT_FACTOR`
  1.3 for the all-to-all buffers: 2 x H200, Ulysses 2, replicated: 66.1 GiB peak, 4.37 GiB of activations
  at 18,983 rows per rank where the line says 3.33. The field notes' ~11.2 GB + 6.2e-4 GB per token (one
  32 GB card, another stack, before its attention/FFN chunking) is ~3.5x steeper than what diffusers'
  path measures here, so it is not used. Compile and fp8 lower the activations (66.5 / 48.1 GiB measured at
  768); the plan does not count that saving. Reference requests (ref2va) raise memory on every rank and are
  not modelled: measure them (docs/capacity.md).
- `linear_precision = "fp16_scaled"` / `weights = "int8"` (h3serve/runtime/fp16_linears.py, int8_weights.py): the
  block linears in 1 byte plus an fp32 scale per output row, the rest in fp16; one int8 weight widened to fp16 at a
  time (the largest, adaln_proj's, 0.48 GiB) as a transient; activations x `FP16_SCALED_ACT_FACTOR` (an estimate:
  the fp32 stream); `attention_backend = "sage"` adds its int8 Q/K and fp16 V copies per row. docs/turing-memory.md.
- FSDP2 (h3serve/services/dit/parallel.py shards each block and the root): each rank holds 1/world_size of
  the weights plus, while it runs, the root unit and two whole blocks (the one running and the prefetched
  next). Checked: 2 x H200, Ulysses 2, FSDP2 measured 37.7 GiB per rank; this model says 37.8.
  fsdp_offload keeps the shards in host memory (only the gathered blocks stay); group offload (diffusers'
  block-level, one block per group, a CUDA stream prefetching the next) keeps what is outside the 50 blocks
  plus two blocks.
- Text encoder: weights as above; `spread` divides them evenly over the process's GPUs (accelerate's
  balanced map); `cpu_offload` holds at most the embedding and one decoder layer on the GPU (streamed: the
  embedding alone, then a layer and the prefetched next, which is less). Activations (an
  estimate, not measured): every hidden state (52 x 5120) and one MLP intermediate (3 x 25,600) in bf16 per
  token of the longest prompt (`max_prompt_tokens`), plus 0.25 GiB.
- VAE decode (`VAE_ACT_*`): calibrated on OUR measurement (BENCHMARKS.md vae_decode_768x1344x124: 11.2 GiB
  peak at tile_batch 1, 14.0 GiB at 28): the weights (5.75 GiB in bf16: fp32 encoder and audio VAE), the
  decoded frames twice in fp32 on the device, 2.6 GiB of tile work and 0.104 GiB per extra tile per call.
  Condition encoding (fl2va / ref2va media) is not modelled. `offload = "idle"`: the weights are onloaded for
  a request and held in host memory (pinned arenas) between requests.
- A card's total: every process at its own peak, added up; with `[gateway] stages_take_turns` (one stage call at a
  time) the busiest turn instead: one process at its peak, every other idle (its resident weights and context:
  each service hands its allocator's cache back after every request).
- Per process and GPU (estimates): 0.5 GiB of CUDA context (outside the allocator and outside
  `memory_limit_gib`'s cap), 0.25 GiB more of NCCL buffers on a DiT rank of a group, and 5 % of the allocator's
  peak for fragmentation (inside the cap).

Host memory (`host_plan`, `check_host`): the peak of each process's PRIVATE host memory (anonymous + pinned +
shared memory, RssAnon + RssShmem: what the kernel cannot drop, what the OOM killer counts) in two phases, `start`
(load, quantise, pin, adapters) and `serving`; memory-mapped files' pages (the fp8 store's) are reported apart as
file pages, page cache the kernel reclaims. From the current code (read, not measured, unless it says so):

- Every model process: `PROCESS_BASE_GIB` of runtime. Measured: the tiny CPU stack's services 0.5-0.6 GiB each
  (`CPU_PROCESS_BASE_GIB`); on one H200 (torch 2.11) a bare process with torch, CUDA, cuBLAS and cuDNN 0.46 GiB,
  0.93 with one torch.compile (its compile worker). Those do not explain the e2e measurement below, so
  `PROCESS_BASE_GIB` (a process on CUDA) is CALIBRATED on it: the measured 49.2 GiB less what this model names
  (the weights and buffers below, the gateway and the DiT's launcher), over the three CUDA processes, rounded:
  (49.2 - 34.0) / 3 = 5.1 -> 5.0. It holds what is not modelled one by one (Inductor's compile, the CUDA host
  allocator's cached blocks, load transients, gRPC buffers): an estimate from one profile, not a constant of
  CUDA. The gateway: `GATEWAY_GIB` 0.3 (the tiny stack); the DiT's launcher (no torch): `LAUNCHER_GIB` (20 MiB
  at import, measured here).
- Pinned weights (h3serve/runtime/pinned.py): packed into 1 GiB arenas (`ARENA_GIB`: whole GiB, rounded up); a
  tensor larger than an arena is pinned alone and the pinned allocator rounds it up to a power of two: the text
  encoder's 1.45 GiB embedding takes 2 GiB. One H200, the 32 GB profile: the int8 encoder logged "25 arenas of
  1024 MiB" (24.3 GiB without the embedding), so 27 GiB pinned.
- DiT, `offload = "group"` with `fp8_cache_dir` (h3serve/runtime/weight_stream.py): `STAGING_SLOTS` (2) pinned
  slots of one block (0.84 GiB in fp8, rounded up to 1 GiB each); the fp8 weights (43.8 GiB a partition) are the
  store's mapped files: file pages. Start adds the adapters' factors (their file size: read to the host, then
  moved to the GPU) and, with an empty cache, `FP8_BUILD_BLOCKS` (2) blocks' fp8 tensors on their way to the
  writer thread (h3serve/runtime/fp8_store.py build); a filled cache needs neither (planned as empty:
  conservative). Without fp8_cache_dir (h3serve/runtime/offload.py): every weight pinned (arenas), and at start
  the bf16 weights are built in host memory before quantisation. Resident on the GPU: the runtime only (the fp8
  save copies storage by storage). FSDP with fsdp_offload: each rank's shard pinned (total / world_size).
- Encoder, cpu_offload: its weights pinned as above; with int8 it is built layer by layer on the GPU from the model
  directory's safetensors or `random:full`'s draws (+ one quantised layer on the host); with bf16 the whole model
  is loaded into host memory first.
  Spread and quantized: built layer by layer on its GPUs (placement.build_spread), the runtime only. Otherwise
  without cpu_offload on a GPU: quantize or spread stage the bf16 model in host memory at start; a plain load goes
  to the GPU (the runtime only).
- VAE: the runtime (weights on the GPU; with `offload = "idle"`, pinned in arenas as well). Any service on the CPU
  (the demo): its weights are private host memory.
  The tiny preset (`[model] dir` empty, or a directory of under `SMALL_MODEL_GIB` of safetensors files) has no
  weights worth counting; any other directory is planned at the released sizes, as above.
- `h3serve up` starts the processes together, so the deployment's start peak is planned as the sum of every
  process's start peak (conservative: they need not peak at once).

Measured (one H200, `python -m bench.e2e --side services --warm-start --deploy docs/deploy/single-32gb.toml
--sizes 768x1344x124 --steps 4 --repeats 1 --adapter-rank 128 --flow-shift 6 --fp8-cache DIR --compile-cache DIR`,
every service process's private memory sampled each 0.5 s from before the start, BENCHMARKS.md): empty caches
49.2 GiB private at most (+45.8 GiB mapped file pages), filled caches 48.0 (+44.5). With its 2.42 GiB adapter
(rank 128 on every block linear) this model predicts 49.0 GiB at start (tests/test_host_plan.py).

The largest request planned for: the deployment's default canvas (the largest it serves, `[model]`
geometry) at the longest clip (345 frames), bounded by what admission lets through (`[gateway] capacity`
for that canvas over the served workflows, `max_rows`); `--frames` / `--canvas` plan for another.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.common.config import (
    FILE_PARTITION,
    GGUF,
    SERVICES,
    DeployConfig,
    DiTConfig,
    EncoderConfig,
    ModelServiceConfig,
    VaeConfig,
)
from h3serve.model import rules, workflows

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANT_BYTES = {"int8": 1.0, "nf4": 0.5625}  # per quantised weight; "none": the dtype's

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
PROCESS_BASE_GIB = 5.0  # a model process on CUDA: calibrated (module docstring)
CPU_PROCESS_BASE_GIB = 0.6  # a model process on the CPU: measured, the tiny stack
GATEWAY_GIB = 0.3
LAUNCHER_GIB = 0.05
HOST_RESERVE_GIB = 4.0  # left to the OS, page tables and whatever else the host runs
ARENA_GIB = 1  # h3serve/runtime/pinned.py ARENA_BYTES (tests/test_host_plan.py checks they agree)
STAGING_SLOTS = 2  # h3serve/runtime/weight_stream.py's (the same check)
SMALL_MODEL_GIB = 1.0  # a model directory with fewer GiB of weights is not the released model
FP8_BUILD_BLOCKS = 2  # h3serve/runtime/fp8_store.py build: blocks' fp8 tensors held for the writer at most
# linear_precision = "fp16_scaled": the stream and the SwiGLU product in fp32 (fp16_linears.py); an ESTIMATE from the
# tensors alive per row at the FFN's peak (fp16 and fp32 copies of the 28,672-wide projection, two fp32 14,336-wide
# halves: ~2 x the bf16 path's), not measured: bench/turing_linears.py prints the measured peak at 480x832x124
FP16_SCALED_ACT_FACTOR = 2.0
# attention_backend = "sage": its int8 Q and K copies and fp16 V, per element of q/k/v (56 heads x 128 per row)
SAGE_WORKSPACE_BYTES_PER_ROW = (2 * 1 + 2) * 56 * 128


@dataclass(frozen=True)
class TransformerCounts:
    """MiniMaxH3Transformer3DModel() (the released config): one partition."""

    total: int = 33_122_992_896
    fp32: int = 17_222_144  # _keep_in_fp32_modules: proj_in, time_embedder, proj_out, ...
    blocks: int = 50
    block: int = 645_571_840  # one of transformer_blocks
    fp8_linears: int = 19_267_584_000  # fastpath.fp8_target's linears, all blocks (adaln_proj stays bf16)
    fsdp_root: int = 44_758_016  # what no FSDP unit (a block, a refiner block, norm_out) holds
    int8_linears: int = 32_273_203_200  # weights = "int8": every block linear's weight (645,464,064 a block)
    int8_rows: int = 7_884_800  # their output rows, an fp32 scale each (157,696 a block)
    largest_linear: int = 260_112_384  # adaln_proj.linear: the fp16 copy an int8 weight is widened into

    def bytes(self, dtype: str, fp8: bool, int8: bool = False) -> float:
        quantised = self.fp8_linears if fp8 else 0
        if int8:
            return (
                self.fp32 * 4
                + (self.total - self.fp32 - self.int8_linears) * 2
                + self.int8_linears
                + self.int8_rows * 4
            )
        return self.fp32 * 4 + (self.total - self.fp32 - quantised) * DTYPE_BYTES[dtype] + quantised

    def block_bytes(self, dtype: str, fp8: bool, int8: bool = False) -> float:
        if int8:
            return (self.block * 2 - self.int8_linears // self.blocks) + self.int8_rows // self.blocks * 4
        quantised = self.fp8_linears // self.blocks if fp8 else 0
        return (self.block - quantised) * DTYPE_BYTES[dtype] + quantised

    def outside_blocks_bytes(self, dtype: str) -> float:
        """Everything but the 50 blocks (the fp32 modules included): what group offload keeps on the GPU."""
        return self.bytes(dtype, False) - self.blocks * self.block * DTYPE_BYTES[dtype]

    def fsdp_root_bytes(self, dtype: str) -> float:
        return self.fp32 * 4 + (self.fsdp_root - self.fp32) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class VaeCounts:
    total: int
    fp32: int  # _keep_in_fp32_modules
    fp8_linears: int = 0  # the ViT decoder's block linears `fastpath.quantize_fp8` picks (the video VAE's)

    def bytes(self, dtype: str, fp8: bool = False) -> float:
        quantised = self.fp8_linears if fp8 else 0
        return self.fp32 * 4 + (self.total - self.fp32 - quantised) * DTYPE_BYTES[dtype] + quantised


@dataclass(frozen=True)
class TextEncoderCounts:
    """Qwen3VLForConditionalGeneration at Qwen3-VL-32B's sizes as a service holds it: 51 decoder layers and no
    language-model head (h3serve/runtime/models.py drop_unread_parts)."""

    total: int = 26_240_699_376
    layers: int = 51
    layer: int = 487_598_336
    layer_linears: int = 24_866_979_840  # every decoder layer's linears: what int8 / nf4 quantise
    embedding: int = 777_912_320  # embed_tokens (not quantised)

    @property
    def quantisable(self) -> int:
        return self.layer_linears

    def bytes(self, dtype: str, quantize: str) -> float:
        per = QUANT_BYTES.get(quantize, DTYPE_BYTES[dtype])
        return (self.total - self.quantisable) * DTYPE_BYTES[dtype] + self.quantisable * per

    def layer_bytes(self, dtype: str, quantize: str) -> float:
        """One decoder layer, its linears quantised."""
        per, linears = QUANT_BYTES.get(quantize, DTYPE_BYTES[dtype]), self.layer_linears // self.layers
        return (self.layer - linears) * DTYPE_BYTES[dtype] + linears * per

    def offloaded_bytes(self, dtype: str, quantize: str) -> float:
        """cpu_offload: the embedding and one decoder layer, a bound on what the streamed offload holds at once (the
        embedding alone, then a layer and the prefetched next)."""
        per, linears = QUANT_BYTES.get(quantize, DTYPE_BYTES[dtype]), self.layer_linears // self.layers
        return (self.embedding + self.layer - linears) * DTYPE_BYTES[dtype] + linears * per


TRANSFORMER = TransformerCounts()
VIDEO_VAE = VaeCounts(total=2_603_868_984, fp32=180_636_896, fp8_linears=2_415_919_104)
AUDIO_VAE = VaeCounts(total=151_321_489, fp32=151_321_489)
TEXT_ENCODER = TextEncoderCounts()


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


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _listed(gpus: str) -> list[str]:
    return [gpu.strip() for gpu in gpus.split(",") if gpu.strip()]


def _on_gpu(service: ModelServiceConfig) -> bool:
    return service.device.split(":")[0] == "cuda"


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
    """The request to plan for (module docstring): by default the largest canvas at the longest clip, bounded by
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
    total, block = (_gib(nbytes) for nbytes in dit_weights(dit))
    fsdp = dit.fsdp and world > 1
    if _is_gguf(dit) and _gguf_bytes(dit) is None:
        notes.append(f"[dit] transformer_file {dit.transformer_file!r} is not here: its partition counted in bf16")
    if dit.offload == "group":
        # one partition runs at a time: its outside-the-blocks group and two blocks are on the GPU
        weights, transient, host = 0.0, _gib(TRANSFORMER.outside_blocks_bytes(dit.dtype)) + 2 * block, total
    elif fsdp:
        transient = _gib(TRANSFORMER.fsdp_root_bytes(dit.dtype)) + 2 * block
        weights, host = (0.0, total / world) if dit.fsdp_offload else (total / world, 0.0)
    else:
        weights, transient, host = total, 0.0, 0.0
    rows = math.ceil(work.rows / world)
    activations = DIT_ACT_FIXED_GIB + DIT_ACT_PER_ROW_GIB * rows * (DIT_SPLIT_FACTOR if world > 1 else 1.0)
    activations *= FP16_SCALED_ACT_FACTOR if dit.linear_precision == "fp16_scaled" else 1.0
    if dit.attention_backend == "sage":  # Ulysses: a rank attends all rows over its heads, the same bytes
        activations += _gib(SAGE_WORKSPACE_BYTES_PER_ROW * rows)
    if dit.weights == "int8":  # one int8 weight widened to fp16 at a time
        transient += _gib(TRANSFORMER.largest_linear * DTYPE_BYTES["float16"])
    adapters = sum(_file_gib(source.path) for source in dit.adapters.values())
    weights += adapters / world if fsdp else adapters
    if count > 1:
        notes.append(f"[dit] workflows {list(dit.workflows)} load {count} partitions ({', '.join(partitions)})")
    if dit.nnodes > 1:
        notes.append(f"[dit] nnodes = {dit.nnodes}: the GPUs shown are one node's; every node holds the same")
    gpus = _device_gpus(dit, per_node, notes, "dit") if _on_gpu(dit) else []
    if _on_gpu(dit) and len(gpus) < per_node:
        notes.append(f"[dit] {per_node} ranks per node but gpus = {dit.gpus!r} names {len(gpus)}")
    nccl = NCCL_GIB if world > 1 else 0.0
    return [
        Share(gpu, f"dit rank {rank}", weights, transient, activations, dit.memory_limit_gib, host, nccl)
        for rank, gpu in enumerate(gpus)
    ]


def dit_weights(dit: DiTConfig) -> tuple[float, float]:
    """(every partition's weights, the largest block's) in bytes, each partition counted from the dtype and fp8, or
    a GGUF transformer_file's as the file holds it (kept quantised: the file's size, its blocks an equal share)."""
    partitions = {workflows.by_name(name).partition for name in dit.workflows}
    int8 = dit.weights == "int8"
    counted = TRANSFORMER.bytes(dit.dtype, dit.fp8, int8), TRANSFORMER.block_bytes(dit.dtype, dit.fp8, int8)
    gguf = _gguf_bytes(dit)
    sizes = [
        (gguf, gguf / TRANSFORMER.blocks) if gguf is not None and partition == FILE_PARTITION else counted
        for partition in partitions
    ]
    return sum(total for total, _ in sizes), max(block for _, block in sizes)


def _is_gguf(dit: DiTConfig) -> bool:
    return dit.transformer_file.lower().endswith(GGUF)


def _gguf_bytes(dit: DiTConfig) -> float | None:
    """A GGUF transformer_file's size, None for none or when it is not on this machine."""
    if not _is_gguf(dit):
        return None
    try:
        return float(os.path.getsize(dit.transformer_file))
    except OSError:
        return None


def _file_gib(path: str) -> float:
    try:
        return _gib(os.path.getsize(path))
    except OSError:
        return 0.0


def _encoder_shares(encoder: EncoderConfig, notes: list[str]) -> list[Share]:
    if not _on_gpu(encoder):
        return []
    listed = _listed(encoder.gpus)
    gpus = _device_gpus(encoder, len(listed) if encoder.spread and listed else 1, notes, "encoder")
    full = _gib(TEXT_ENCODER.bytes(encoder.dtype, encoder.quantize))
    activations = ENCODER_ACT_FIXED_GIB + _gib(ENCODER_ACT_PER_TOKEN_BYTES * encoder.max_prompt_tokens)
    if encoder.cpu_offload:
        weights, transient, host = 0.0, _gib(TEXT_ENCODER.offloaded_bytes(encoder.dtype, encoder.quantize)), full
    else:
        weights, transient, host = full / len(gpus), 0.0, 0.0
    return [
        Share(gpu, "encoder", weights, transient, activations, encoder.memory_limit_gib, host if i == 0 else 0.0)
        for i, gpu in enumerate(gpus)
    ]


def _vae_shares(vae: VaeConfig, work: Workload, notes: list[str]) -> list[Share]:
    if not _on_gpu(vae):
        return []
    weights = _gib(VIDEO_VAE.bytes(vae.dtype, vae.fp8) + AUDIO_VAE.bytes(vae.dtype))
    frames = _gib(2 * work.pixels_frames * 3 * 4)  # held on the first GPU only: replicas send their tiles there
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
        Share(gpu, "vae decode replica", _gib(VIDEO_VAE.bytes(vae.dtype, vae.fp8)), 0.0, tiles, vae.memory_limit_gib)
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


# Host memory (module docstring): each process's private peak at start and while serving.


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
    alone = sum(2 ** math.ceil(math.log2(_gib(size))) for size in large)
    return math.ceil(_gib(nbytes - sum(large)) / ARENA_GIB) * ARENA_GIB + alone


def _runtime(service: ModelServiceConfig) -> float:
    return PROCESS_BASE_GIB if _on_gpu(service) else CPU_PROCESS_BASE_GIB


def _tiny(service: ModelServiceConfig) -> bool:
    """The built-in tiny preset, or a model directory whose weights are that small (the tiny preset saved, as the
    tests' stacks load it): megabytes of weights, not the released sizes the plan assumes."""
    return not service.model_dir or _small_directory(service.model_dir)


@functools.cache
def _small_directory(model_dir: str) -> bool:
    if not os.path.isdir(model_dir):
        return False  # not on this machine (a plan for another host), or random:full: the released sizes
    weights = sum(_file_gib(str(path)) for path in Path(model_dir).rglob("*.safetensors"))
    return weights < SMALL_MODEL_GIB


def dit_host(dit: DiTConfig) -> HostNeed:
    """The DiT's processes on one node: its launcher and world_size / nnodes ranks."""
    ranks = dit.world_size // dit.nnodes
    runtime = {"launcher": LAUNCHER_GIB, "runtime": ranks * _runtime(dit)}
    adapters = {"adapters": ranks * sum(_file_gib(source.path) for source in dit.adapters.values())}
    count = len({workflows.by_name(name).partition for name in dit.workflows})
    weights, block = dit_weights(dit)
    if _tiny(dit):
        return HostNeed("dit", {**runtime, **adapters}, runtime)
    if not _on_gpu(dit):
        held = {"weights": ranks * _gib(weights)}
        return HostNeed("dit", {**runtime, **held, **adapters}, {**runtime, **held})
    if dit.offload == "group" and dit.fp8_cache_dir:
        staging = {"staging": STAGING_SLOTS * pinned_gib(block, (block,) if block > ARENA_GIB * GIB else ())}
        build = {"fp8 build": FP8_BUILD_BLOCKS * _gib(block)}
        return HostNeed("dit", {**runtime, **staging, **adapters, **build}, {**runtime, **staging}, _gib(weights))
    if dit.offload == "group":
        pinned = {"pinned weights": pinned_gib(weights)}
        # at start the weights are built in bf16 (fp8 quantises them after); a GGUF is read as it stays, quantised
        gguf = _gguf_bytes(dit) is not None
        read = weights if gguf else TRANSFORMER.bytes(dit.dtype, False) * count
        start = {"GGUF read" if gguf else "bf16 build": max(_gib(read), pinned["pinned weights"])}
        return HostNeed("dit", {**runtime, **start, **adapters}, {**runtime, **pinned})
    if dit.fsdp and dit.fsdp_offload and dit.world_size > 1:
        shards = {"pinned shards": ranks * _gib(weights) / dit.world_size}
        return HostNeed("dit", {**runtime, **shards, **adapters}, {**runtime, **shards})
    return HostNeed("dit", {**runtime, **adapters}, runtime)


def encoder_host(encoder: EncoderConfig, quantize: str | None = None) -> HostNeed:
    """The text encoder's process; `quantize` plans another setting than the configured one."""
    quantize = quantize or encoder.quantize
    runtime = {"runtime": _runtime(encoder)}
    if _tiny(encoder):
        return HostNeed("encoder", runtime, runtime)
    bf16 = _gib(TEXT_ENCODER.bytes(encoder.dtype, "none"))
    weights = TEXT_ENCODER.bytes(encoder.dtype, quantize)
    if not _on_gpu(encoder):  # loaded whole, then quantised in place
        return HostNeed(
            "encoder", {**runtime, "weights": max(bf16, _gib(weights))}, {**runtime, "weights": _gib(weights)}
        )
    if encoder.cpu_offload:
        embedding = TEXT_ENCODER.embedding * DTYPE_BYTES[encoder.dtype]
        pinned = {"pinned weights": pinned_gib(weights, (embedding,) if embedding > ARENA_GIB * GIB else ())}
        if quantize != "none":  # built layer by layer on the GPU (placement.layer_weights)
            layer = {"one layer": _gib(TEXT_ENCODER.layer_bytes(encoder.dtype, quantize))}
            return HostNeed("encoder", {**runtime, **pinned, **layer}, {**runtime, **pinned})
        return HostNeed("encoder", {**runtime, "bf16 load": max(bf16, pinned["pinned weights"])}, {**runtime, **pinned})
    if quantize != "none" and encoder.spread:  # built layer by layer on its GPUs (placement.build_spread)
        return HostNeed("encoder", runtime, runtime)
    if quantize != "none" or encoder.spread:  # staged on the CPU, placed from there
        return HostNeed("encoder", {**runtime, "bf16 load": bf16}, runtime)
    return HostNeed("encoder", runtime, runtime)


def vae_host(vae: VaeConfig) -> HostNeed:
    runtime = {"runtime": _runtime(vae)}
    if _tiny(vae) or (_on_gpu(vae) and vae.offload == "none"):
        return HostNeed("vae", runtime, runtime)
    weights = _gib(VIDEO_VAE.bytes(vae.dtype) + AUDIO_VAE.bytes(vae.dtype))
    held = {"pinned weights": pinned_gib(weights * GIB)} if _on_gpu(vae) else {"weights": weights}
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
    if not (encoder.cpu_offload and encoder.quantize == "none" and _on_gpu(encoder)) or _tiny(encoder):
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
