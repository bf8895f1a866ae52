"""Typed configuration for every h3serve process, read from one TOML deployment file.

Each section ([encoder], [dit], [vae], [gateway]) maps onto a frozen pydantic model; command-line flags
override single fields. `[model] dir` points every model service at a local diffusers model
directory; empty means the built-in tiny preset. Every value is checked by type and range when the file
is read, so a bad deployment fails at start with one line per problem naming the file, section and key.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from h3serve.model import adapters as adapter_rules
from h3serve.model import rules
from h3serve.model.rules import Geometry
from h3serve.model.workflows import names as workflow_names

if TYPE_CHECKING:  # pydantic's own dependency; read by the type checker only
    from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A refused deployment file or flag; the message has one line per problem."""


# Phases the watchdog times: the stage call starts a phase; each progress event restarts its clock.
STALL_DEFAULTS = {"encode": 300.0, "denoise": 900.0, "decode": 600.0, "mux": 300.0}
# How long a job waits for a stage with no replica that can take its call (down, restarting, loading
# weights) before it fails UNAVAILABLE: a DiT group restart reloads the transformer, so the DiT waits longest.
OUTAGE_DEFAULTS = {"encoder": 300.0, "vae-encode": 300.0, "dit": 900.0, "vae": 300.0}
DAY_S = 24 * 3600.0

FLOAT16_REFUSED = (
    "float16 is refused for the MiniMax-H3 DiT: its activations pass float16's largest value (65504) "
    "and the video turns black; use bfloat16, and for fp16 tensor cores (sm_75) "
    'linear_precision = "fp16_scaled" (fp16 GEMMs that cannot overflow)'
)

# Limits both the gateway and a service hold to: one definition, the default of both sections; a deployment whose
# gateway admits more than its service takes is refused (`_gateway_within_services`)
MAX_PROMPT_CHARS = 8192
MAX_STEPS = 200
DEFAULT_STEPS = 50
MAX_ROWS = 200_000

Port = Annotated[int, Field(ge=0, le=65535)]
# [gateway] open_without_token: a part of the public API that may answer without a token, to all or on loopback
OpenPart = Literal["docs", "reflection", "metrics", "docs@loopback", "reflection@loopback", "metrics@loopback"]
Steps = Annotated[int, Field(ge=rules.MIN_STEPS)]  # num_inference_steps: N steps are N-1 transformer forwards
DType = Literal["float32", "bfloat16", "float16"]  # h3serve.runtime.models.DTYPES (which imports torch)
if TYPE_CHECKING:  # Literals built from values at run time, which a type checker cannot read: their value type
    Phase = str
    StageName = str
    Workflows = tuple[str, ...]
else:
    Phase = Literal[tuple(STALL_DEFAULTS)]
    StageName = Literal[tuple(OUTAGE_DEFAULTS)]
    # TOML: a list
    Workflows = Annotated[tuple[Literal[tuple(workflow_names())], ...], Field(min_length=1, strict=False)]


SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)")
# [dit] transformer_file: its formats, and the partition it replaces (h3serve/runtime/checkpoints.py loads it)
SAFETENSORS, GGUF = ".safetensors", ".gguf"
FILE_FORMATS = (SAFETENSORS, GGUF)
FILE_PARTITION = "transformer"


def parse_shape(shape: str) -> tuple[int, int, int]:
    """ "HxWxF" as (height, width, frames); ValueError otherwise."""
    match = SHAPE.fullmatch(shape)
    if not match:
        raise ValueError(f'a shape is "HEIGHTxWIDTHxFRAMES", e.g. "480x832x124", got {shape!r}')
    height, width, frames = (int(part) for part in match.groups())
    return height, width, frames


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _joined(value):
    """A list of replica addresses is kept as the comma-separated string `GatewayConfig.replicas` splits."""
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return ",".join(value)
    return value


def _some_address(value: str) -> str:
    if not _addresses(value):
        raise ValueError("at least one address is required")
    return value


Addresses = Annotated[str, BeforeValidator(_joined), AfterValidator(_some_address)]


class Section(BaseModel):
    """A frozen, checked section: unknown keys are refused, and a value must already have its type (strict: the
    string "8" is not the integer 8, 1 is not true), as TOML gives it."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True, protected_namespaces=())

    def replace(self, /, **changes) -> Self:
        """A copy with `changes`, checked like the original (dataclasses.replace for these models)."""
        return type(self)(**{**dict(self), **changes})

    @field_validator("tls_key", check_fields=False)
    @classmethod
    def _tls_pair(cls, key: str, info: ValidationInfo) -> str:
        # info.data holds the fields declared before this one that passed
        if "tls_cert" in info.data and bool(key) != bool(info.data["tls_cert"]):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        return key


class ModelSection(Section):
    """[model]: the model directory and the pipeline geometry (Geometry's keys) that every section shares."""

    dir: str = ""  # empty: the built-in tiny preset
    canvas_short_edge: PositiveInt = Geometry.canvas_short_edge
    canvas_max_pixels: PositiveInt = Geometry.canvas_max_pixels
    reference_image_short_edge: PositiveInt = Geometry.reference_image_short_edge

    def shared(self) -> dict:
        """The fields every section takes from [model]."""
        return {"model_dir": self.dir, "geometry": Geometry(**self.model_dump(exclude={"dir"}))}


class AdapterSource(Section):
    """One `[dit] adapters` entry: a LoRA file (diffusers' layout or an original MiniMax-H3 one, converted by
    diffusers), given as its path or as a table. Its sidecar JSON (same stem, `.json`) is checked with it."""

    path: str
    transformer_ref: bool = False  # diffusers' load_into_transformer_ref: a `transformer.`-prefixed (or original)
    # file goes into the ref2va partition instead of the t2va/fl2va one


def _adapter_source(value):
    return {"path": value} if isinstance(value, str) else value


def _adapter_file(source: AdapterSource) -> AdapterSource:
    if not Path(source.path).is_file():
        raise ValueError(f"no such file: {source.path}")
    if Path(source.path).suffix != ".safetensors":
        raise ValueError(f"must be a .safetensors file (pickled checkpoints are not loaded), got {source.path}")
    adapter_rules.read_sidecar(source.path)
    return source


def _adapter_name(name: str) -> str:
    if not adapter_rules.NAME.fullmatch(name):
        raise ValueError(f"an adapter name is {adapter_rules.NAME_RULE}, got {name!r}")
    return name


AdapterName = Annotated[str, AfterValidator(_adapter_name)]
Adapter = Annotated[AdapterSource, BeforeValidator(_adapter_source), AfterValidator(_adapter_file)]


class ModelServiceConfig(Section):
    """What every model service process (encoder, dit or vae) takes; each has its own section class below, so a key
    of another service's is refused in its section."""

    host: str = "127.0.0.1"
    port: Port = 0
    model_dir: str = ""  # empty: tiny preset
    device: str = "cpu"  # torch device inside the process, e.g. "cuda" (it sees only `gpus`)
    gpus: str = ""  # CUDA_VISIBLE_DEVICES for the process, e.g. "1,2"; empty: inherit
    dtype: DType = "float32"
    max_input_bytes: PositiveInt = 2 << 30  # tensor or media bytes one request may carry (the DiT and the VAE's
    # Decode also hold to what the model's geometry allows)
    auth_token: str = ""  # the gateway's stage_token, required on every RPC but health and reflection
    threads: NonNegativeInt = 0  # torch intra-op threads; 0: torch's default
    tls_cert: str = ""  # PEM certificate chain + key: serve TLS instead of plaintext
    tls_key: str = ""
    geometry: Geometry = Field(default_factory=Geometry)  # from [model]
    memory_limit_gib: NonNegativeFloat = 0.0  # cap on this process's CUDA allocator (each DiT rank's), e.g. 22 to
    # emulate a 22 GB card on a bigger one; 0: the whole device

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def compile_cache(self) -> str:
        """Where this service keeps compiled graphs ("": it compiles nothing, or uses torch's default)."""
        return ""


class CompiledServiceConfig(ModelServiceConfig):
    """A service whose model runs diffusers' blocks with the fast path (h3serve/runtime/fastpath.py): DiT and VAE."""

    attention_backend: str = "native"  # a diffusers attention backend, "flash4" (FlashAttention 4)
    # or "cudnn_fp8" (dit, opt-in: FP8 attention, changes the numbers)
    compile: bool = False  # torch.compile the repeated blocks (h3serve/runtime/fastpath.py)
    compile_dynamic: bool = False  # with compile: symbolic sizes from the first call, one graph per forward
    # variant for every shape (false: torch's default, a static graph first)
    # (the DiT's default is true: see DiTConfig)
    compile_tuning: bool = False  # with compile: Inductor's coordinate-descent tuning of each kernel (minutes of a
    # cold compile: 125 of 153 s at 480x832x124 with fp8 on one H200)
    compile_cache_dir: str = ""  # with compile: Inductor's and Triton's caches here, so a restart loads
    # the compiled graphs (empty: torch's default, under /tmp)
    fp8: bool = False  # fp8 W8A8 block linears (torchao, Hopper; the VAE's: its ViT decoder's); changes the numbers

    @property
    def compile_cache(self) -> str:
        return self.compile_cache_dir if self.compile else ""


class VaeConfig(CompiledServiceConfig):
    """The VAE service: video + audio decode, output checks, the MP4 mux, and condition encoding."""

    max_raw_bytes: NonNegativeInt = 512 << 20  # largest raw.npz payload include_raw may produce
    tile_batch: PositiveInt = 1  # spatial tiles per decoder call; 1 is diffusers' own loop (exact)
    decode_gpus: PositiveInt = 1  # GPUs one decode spreads its tiles over (decoder replicas on the next ones)
    x264_preset: Literal[
        "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow"
    ] = "medium"  # libx264's speed / size trade at CRF 23 (bench/mux.py)
    x264_threads: NonNegativeInt = 0  # libx264's threads; 0: its own count. 1 gives the same bytes for the same frames
    # every time: threaded encodes of identical frames differed under CPU load (3 of ~140 here; the suite sets 1)
    # "idle": the weights (5.75 GiB for the released VAEs) in pinned host memory between requests, on the GPU only
    # during one, so that a card shared with the DiT holds none of them while it denoises (h3serve/runtime/offload.py)
    offload: Literal["none", "idle"] = "none"

    @field_validator("decode_gpus")
    @classmethod
    def _gpus_to_spread_over(cls, count: int, info: ValidationInfo) -> int:
        if count == 1:
            return count
        if not info.data.get("device", "").startswith("cuda"):
            raise ValueError(f'{count} spreads a decode\'s tiles over GPUs: it needs device = "cuda"')
        pinned = [g for g in info.data.get("gpus", "").split(",") if g.strip()]
        if pinned and len(pinned) < count:
            raise ValueError(f'{count} GPUs, but gpus = "{info.data["gpus"]}" lists {len(pinned)}')
        return count

    @field_validator("offload")
    @classmethod
    def _whole_plain_weights(cls, offload: str, info: ValidationInfo) -> str:
        if offload == "idle" and info.data.get("fp8"):
            raise ValueError('"idle" moves plain weights between host and GPU: it needs fp8 = false')
        if offload == "idle" and info.data.get("decode_gpus", 1) > 1:
            raise ValueError('"idle" moves the one VAE a request uses: it needs decode_gpus = 1')
        return offload


class EncoderConfig(ModelServiceConfig):
    """The text encoder service. Qwen3-VL-32B is ~62 GiB in bf16: on small cards it is spread over the
    process's `gpus`, quantized, or offloaded (docs/deploy/small-gpus.md)."""

    cache_bytes: NonNegativeInt = 256 << 20  # embedding cache bound
    max_prompt_chars: PositiveInt = MAX_PROMPT_CHARS  # longest prompt accepted
    max_prompt_tokens: PositiveInt = 2048  # longest prompt accepted, in the tokenizer's tokens

    quantize: Literal["none", "int8", "nf4"] = "none"  # weight-only: int8 (torchao), nf4 (bitsandbytes, sm_75 too);
    # changes the embeddings (the cache key says which)
    spread: bool = False  # the decoder layers spread over every visible GPU (accelerate's device map)
    cpu_offload: bool = False  # weights in pinned host memory, each layer streamed to the device as it runs

    @field_validator("cpu_offload")
    @classmethod
    def _one_placement(cls, offload: bool, info: ValidationInfo) -> bool:
        if offload and info.data.get("spread"):
            raise ValueError("spread and cpu_offload are two placements of the same layers: choose one")
        return offload


class DiTConfig(CompiledServiceConfig):
    """The DiT service: one process group of `world_size` ranks, started by h3serve's launcher on one node
    (h3serve/services/dit/supervisor.py) and by torchrun over several.

    Rank 0 hosts the gRPC server; every rank holds the transformer. See docs/deploy/sharded-dit.md.
    """

    workflows: Workflows = ("t2va", "fl2va", "ref2va")  # served workflows (decides the partitions loaded)
    world_size: PositiveInt = 1  # ranks in the group (all nodes together); 1 runs the same code path
    nnodes: PositiveInt = 1  # nodes; world_size / nnodes ranks start on each (above 1: through torchrun)
    rdzv_endpoint: str = ""  # multi-node: host:port of the c10d rendezvous (torchrun --rdzv-endpoint)
    rdzv_id: str = "h3serve-dit"  # multi-node: job id shared by the nodes' launchers
    fsdp: bool = False  # shard the weights with FSDP2 (memory) instead of replicating them (speed)
    ulysses_degree: NonNegativeInt = 0  # sequence split over heads (all-to-all); 0: world_size when ring_degree is 1
    ring_degree: PositiveInt = 1  # sequence split over keys/values (ring); ulysses x ring = world_size
    max_restarts: NonNegativeInt = 3  # group restarts after a rank dies, then the service exits
    # Prompt lengths vary, so a static first graph serves almost no request, yet costs a compile at start (one
    # H200, 480x832x124, fp8: 183 s static, 208 s dynamic, 1.16 vs 1.19 s/step; BENCHMARKS.md dit_first_call)
    compile_dynamic: bool = True
    restart_backoff_s: NonNegativeFloat = 1.0  # wait before restart k: backoff * 2^(k-1), at most 30 s
    collective_timeout_s: PositiveFloat = 600.0  # a collective that takes longer fails the group (it restarts)
    heartbeat_s: PositiveFloat = 5.0  # idle ranks hear from rank 0 this often; a dead rank shows within this
    max_math_tokens: NonNegativeInt = 4096  # GPU: above this packed length attention never runs on the MATH kernel
    max_steps: Steps = MAX_STEPS  # num_inference_steps accepted (at least the gateway's max_steps)
    max_rows: PositiveInt = MAX_ROWS  # packed rows of one request (at least the gateway's max_rows)
    # LoRA adapters, loaded at start and resident: {name: path or {path, transformer_ref}}; a request names them
    # (GenerationParams.adapters). See docs/adapters.md.
    adapters: dict[AdapterName, Adapter] = Field(default_factory=dict)
    adapter_mode: Literal["unfused", "fused"] = "unfused"  # fused: the one adapter merged into the weights at start
    adapter_slots: PositiveInt = 1  # compile = true: adapters one request may name (slots switched in place)
    fsdp_offload: bool = False  # fsdp = true: parameters live in host memory, each block's gathered to the GPU
    # With fp8 = true: the quantised weights saved here at the first start and assigned at later ones, memory-mapped,
    # instead of loading bf16 and quantising again (h3serve/runtime/fp8_store.py; ~44 GiB for the released model);
    # unfused adapters run over them. With offload = "group" the blocks are streamed from these files.
    fp8_cache_dir: str = ""
    # When a start that quantised writes the served fp8 weights to fp8_cache_dir (resident weights only: a streamed or
    # sharded start writes them before it goes on): "before_serving" holds health NOT_SERVING until they are written
    # (beside the warm-up), so no request runs under the save; "background" turns SERVING without waiting, and the
    # first requests share the machine with the save (h3serve/runtime/fp8_store.py)
    fp8_save: Literal["before_serving", "background"] = "before_serving"
    # Warm start: "HxWxF" shapes denoised (compiled, with compile = true) before health turns SERVING, so the first
    # request is as fast as the hundredth. See docs/performance.md, "Warm start".
    warmup: tuple[str, ...] = Field(default=(), strict=False)
    # num_inference_steps of each warm-up run; unset: what the compile needs (h3serve/services/dit/warmup.py:steps)
    warmup_steps: Steps | None = None
    # one rank, weights in host memory, each block copied to the GPU ahead of its turn: streamed from the fp8 store's
    # memory-mapped files with fp8_cache_dir (h3serve/runtime/weight_stream.py), else pinned whole (runtime/offload.py)
    offload: Literal["none", "group"] = "none"
    # "fp16_scaled": the linears on fp16 tensor cores (sm_75 has none for bf16) without overflow: fp32 residual stream,
    # fp16 GEMMs of x / K times K per layer kind (h3serve/runtime/fp16_linears.py; docs/turing-memory.md)
    linear_precision: Literal["bf16", "fp16_scaled"] = "bf16"
    # "int8": the block linears held as int8 with per-channel scales (~31 GiB), widened to fp16 as each runs
    weights: Literal["bf16", "int8"] = "bf16"
    # The `transformer` partition (t2va, fl2va) from one file users already have: the published single-file layout
    # (.safetensors) or a GGUF of it (.gguf, kept quantised); its config and every other component from [model] dir.
    # A missing or unloadable file is refused at the DiT's start (h3serve/services/dit/transformer_file.py).
    transformer_file: str = ""

    @field_validator("transformer_file")
    @classmethod
    def _file_with_a_model_dir(cls, path: str, info: ValidationInfo) -> str:
        if path and not info.data.get("model_dir", ""):  # with random:full (benchmarks): the released config
            raise ValueError("the transformer's config and every other component come from [model] dir: set it")
        if path and Path(path).suffix.lower() not in FILE_FORMATS:
            raise ValueError(f"a transformer file is {' or '.join(FILE_FORMATS)}, got {path!r}")
        return path

    @field_validator("dtype")
    @classmethod
    def _not_float16(cls, dtype: str) -> str:
        if dtype == "float16":
            raise ValueError(FLOAT16_REFUSED)
        return dtype

    @field_validator("warmup")
    @classmethod
    def _warm_shapes(cls, shapes: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if shapes and "t2va" not in info.data.get("workflows", ("t2va",)):
            raise ValueError("the warm-up runs t2va (text only) on the transformer: add t2va to workflows")
        for shape in shapes:
            height, width, frames = parse_shape(shape)
            if "geometry" in info.data:
                rules.check_resolved_canvas(height, width, info.data["geometry"])
            rules.check_num_frames(frames)
        return shapes

    @field_validator("fsdp_offload")
    @classmethod
    def _offload_needs_fsdp(cls, offload: bool, info: ValidationInfo) -> bool:
        if offload and not info.data.get("fsdp"):
            raise ValueError("fsdp_offload keeps FSDP2's shards in host memory: it needs fsdp = true")
        return offload

    @field_validator("fp8_cache_dir")
    @classmethod
    def _fp8_to_cache(cls, directory: str, info: ValidationInfo) -> str:
        if directory and not info.data.get("fp8"):
            raise ValueError("fp8_cache_dir keeps the fp8-quantised weights: it needs fp8 = true")
        if directory and info.data.get("adapters") and info.data.get("adapter_mode") == "fused":
            raise ValueError(
                "fp8_cache_dir holds the transformer quantised without adapters, and a fused adapter is "
                'merged into the weights before quantisation: use adapter_mode = "unfused" (adapters '
                'over the cached fp8 weights) or fp8_cache_dir = ""'
            )
        return directory

    @field_validator("offload")
    @classmethod
    def _group_offload_one_rank(cls, offload: str, info: ValidationInfo) -> str:
        if offload == "group" and info.data.get("world_size", 1) > 1:
            raise ValueError('"group" offload runs one rank; a group of ranks shards with fsdp (and fsdp_offload)')
        return offload

    @field_validator("linear_precision")
    @classmethod
    def _scaled_from_bf16(cls, precision: str, info: ValidationInfo) -> str:
        if precision == "bf16":
            return precision
        if info.data.get("dtype") != "bfloat16" or info.data.get("fp8"):
            raise ValueError('"fp16_scaled" converts the bf16 linears: it needs dtype = "bfloat16" and fp8 = false')
        if info.data.get("adapters") or info.data.get("offload") == "group":
            raise ValueError('"fp16_scaled" is not served with adapters or offload = "group"')
        return precision

    @field_validator("weights")
    @classmethod
    def _int8_through_fp16(cls, weights: str, info: ValidationInfo) -> str:
        if weights == "int8" and info.data.get("linear_precision") != "fp16_scaled":
            raise ValueError('"int8" weights are widened into the fp16 GEMM: it needs linear_precision = "fp16_scaled"')
        return weights

    @field_validator("adapter_mode")
    @classmethod
    def _fused_needs_one(cls, mode: str, info: ValidationInfo) -> str:
        if mode == "fused" and "adapters" in info.data and len(info.data["adapters"]) != 1:
            raise ValueError(
                f'"fused" merges exactly one adapter into the weights; adapters has {len(info.data["adapters"])}'
            )
        return mode


MESSAGE_ENVELOPE_BYTES = 64 << 10  # a message's fields other than its largest one (a chunk's file name, ...)


class GatewayConfig(Section):
    host: str = "127.0.0.1"
    port: Port = 50050
    data_dir: str = "var/gateway"  # SQLite database and artifacts
    # The job store on PostgreSQL instead of data_dir's SQLite file (docs/storage.md; the `postgres` extra)
    store_url: str = Field(default="", pattern=r"^(postgres(ql)?://.*)?$")
    # A stage address may also be a list (or a comma-separated string) of replica addresses.
    encoder: Addresses = "127.0.0.1:50051"  # stage addresses
    dit: Addresses = "127.0.0.1:50052"
    vae: Addresses = "127.0.0.1:50053"
    max_prompt_chars: PositiveInt = MAX_PROMPT_CHARS  # at most the encoder's
    max_prompt_tokens: PositiveInt = 2048  # the prompt in the tokenizer's tokens (a character is up to 4)
    max_steps: Steps = MAX_STEPS  # at most the DiT's
    default_steps: Steps = DEFAULT_STEPS  # at most max_steps
    encode_deadline_s: PositiveFloat = 600.0  # per stage call
    denoise_deadline_s: PositiveFloat = 3600.0
    decode_deadline_s: PositiveFloat = 1800.0
    # A stage call failing UNAVAILABLE (the replica is down or restarting) is tried again, on the next replica,
    # with back-off from retry_backoff_s doubling to max_backoff_s, until the stage's outage limit has passed. Past
    # it the job waits on while `h3serve up` says it is bringing the stage's service back (a start or restart, each
    # within [supervisor] start_timeout_s), and for the limit again from when it serves (common/supervision.py).
    retry_backoff_s: NonNegativeFloat = 0.5
    max_backoff_s: PositiveFloat = 5.0
    outage_s: dict[StageName, PositiveFloat] = Field(default_factory=lambda: dict(OUTAGE_DEFAULTS))
    max_image_bytes: PositiveInt = 20 << 20  # UploadAsset limits, per asset
    max_video_bytes: PositiveInt = 100 << 20
    max_audio_bytes: PositiveInt = 30 << 20
    max_image_pixels: PositiveInt = 8192 * 8192
    max_video_pixels: PositiveInt = 3840 * 2160  # per frame
    max_video_seconds: PositiveFloat = 60.0
    max_audio_seconds: PositiveFloat = 60.0
    max_rows: PositiveInt = MAX_ROWS  # admission (at most the DiT's): packed DiT rows per request (text,
    # conditioning, generated)
    # The encoder, DiT and VAE share one card too small for two of their stages at once: every stage call waits for
    # the card (one at a time, in arrival order) instead of overlapping with another job's (docs/deploy/small-gpus.md)
    stages_take_turns: bool = False
    geometry: Geometry = Field(default_factory=Geometry)  # from [model]
    model_dir: str = ""  # from [model] dir: admission counts text rows with its tokenizer and processor
    # the deployment file it was read from (load_deploy sets it): admission plans the largest request each workflow
    # can hold from the whole deployment (h3serve/common/ceilings.py); empty: no plan, max_rows and capacity only
    deploy_file: str = ""
    max_unfinished_jobs: NonNegativeInt = 64  # queue bound: queued + running jobs; beyond it Submit is refused
    # with RESOURCE_EXHAUSTED (0: no bound)
    max_attempts: PositiveInt = 3  # runs of one job: re-runs after a stalled stage; a gateway restart spends none
    # (its own bound: runner.MAX_RESTART_RERUNS re-runs of a job caught in a stage)
    # Per-phase stall limits in seconds, measured from the phase's last progress event.
    stall_s: dict[Phase, PositiveFloat] = Field(default_factory=lambda: dict(STALL_DEFAULTS))
    # Admission capacity: {workflow: {"HxW" or "*": max packed-sequence rows}}; a canvas not listed
    # (and no "*") is not limited. See docs/capacity.md for measuring it.
    capacity: dict[str, dict[str, PositiveInt]] = Field(default_factory=dict)
    metrics_port: Port = 0  # Prometheus /metrics on this HTTP port (0: off)
    metrics_host: str = "127.0.0.1"
    http_port: Port = 0  # the HTTP door: OpenAI's /v1/videos, SSE events, the web console (0: off)
    http_host: str = "127.0.0.1"  # served with tls_cert / tls_key and auth_token as the gRPC door
    auth_token: str = ""  # bearer token the public API requires (empty: no check); its client is named "default"
    # Named clients, each with its own token, jobs and uploads (docs/tenants.md): a TOML file of [clients.NAME]
    # tables, tokens hashed; read again on SIGHUP. Empty: none. With it or auth_token, every call needs a token
    clients_file: str = ""
    max_unfinished_jobs_per_client: NonNegativeInt = 0  # each client's bound on its queued + running jobs (0: none;
    # a client's own max_unfinished_jobs in the clients file overrides it); max_unfinished_jobs bounds them all
    # What answers without a token when the gateway has one (health always does): "reflection" (gRPC server
    # reflection), "docs" (the HTTP door's /openapi.json and /docs), "metrics" (else an admin client's token); with
    # "@loopback", only to callers on this machine
    open_without_token: Annotated[tuple[OpenPart, ...], Field(strict=False)] = (
        "docs@loopback",
        "reflection@loopback",
        "metrics@loopback",
    )
    # Webhooks (docs/webhooks.md): an endpoint that does not answer 2xx within webhook_timeout_s is tried again after
    # webhook_backoff_s, doubling up to webhook_max_backoff_s, webhook_max_attempts times in all, across restarts
    webhook_timeout_s: PositiveFloat = 10.0
    webhook_backoff_s: PositiveFloat = 1.0
    webhook_max_backoff_s: PositiveFloat = 600.0
    webhook_max_attempts: PositiveInt = 20
    tls_cert: str = ""  # PEM files: serve the public API over TLS
    tls_key: str = ""
    stage_tls_ca: str = ""  # PEM root for TLS stage services (empty: plaintext to the stages)
    stage_token: str = ""  # sent to every stage service as `authorization: Bearer <token>` (their
    # auth_token; empty: none)
    max_request_bytes: PositiveInt = 4 << 20  # largest request message the public API accepts (uploads come in chunks)
    # Retention, enforced after every job and every minute (0: keep for ever / no cap).
    artifact_max_age_s: NonNegativeFloat = 7 * DAY_S  # artifacts older than this are deleted
    artifact_max_bytes: NonNegativeInt = 50 << 30  # beyond this many artifact bytes the oldest go first
    # A finished clip whose artifact the disk cannot hold waits this long for space (its job's `waiting` event says
    # where, what is free and what it needs), is written when space returns, and past it fails naming the disk
    # (0: fails at once)
    artifact_space_wait_s: NonNegativeFloat = 1800.0
    asset_max_age_s: NonNegativeFloat = 7 * DAY_S  # uploads older than this go unless a queued or running job
    # names them

    @field_validator("outage_s")
    @classmethod
    def _every_stage(cls, limits: dict[str, float]) -> dict[str, float]:
        """A table naming some stages keeps the defaults of the others (a stage without a limit failed its jobs)."""
        return {**OUTAGE_DEFAULTS, **limits}

    @field_validator("default_steps")
    @classmethod
    def _within_max_steps(cls, steps: int, info: ValidationInfo) -> int:
        if "max_steps" in info.data and steps > info.data["max_steps"]:
            raise ValueError(f"must be within 2..max_steps ({info.data['max_steps']}), got {steps}")
        return steps

    def replicas(self, stage: str) -> tuple[str, ...]:
        """The replica addresses of a stage ("encoder", "dit", "vae")."""
        return _addresses(getattr(self, stage))

    def largest_upload_bytes(self) -> int:
        return max(self.max_image_bytes, self.max_video_bytes, self.max_audio_bytes)

    def largest_message_bytes(self) -> int:
        """The gRPC door's receive limit: the largest legal message (a request of max_request_bytes, or a whole
        upload sent as one chunk) and room for its envelope. Every message a limit of a field would refuse arrives
        (up to this), so that it is refused by name (INVALID_ARGUMENT), never as RESOURCE_EXHAUSTED by the
        transport, which reads like a full queue."""
        return max(self.max_request_bytes, self.largest_upload_bytes()) + MESSAGE_ENVELOPE_BYTES


class SupervisorConfig(Section):
    """[supervisor]: how `h3serve up` restarts a service that exits, and how long a stop may take."""

    max_restarts: NonNegativeInt = 5  # restarts of one service within window_s; the next exit stops `up` (exit 1)
    window_s: PositiveFloat = 300.0
    backoff_s: NonNegativeFloat = 1.0  # wait before the k-th restart within the window: backoff_s * 2^(k-1) ...
    max_backoff_s: NonNegativeFloat = 30.0  # ... at most this
    stop_grace_s: PositiveFloat = 30.0  # SIGTERM to SIGKILL; above the DiT launcher's own grace for its ranks
    # Start to SERVING, for every start and restart: a start past it is stopped and counts as an exit; [dit] warmup
    # shapes compile first (minutes each)
    start_timeout_s: PositiveFloat = 300.0
    # start the model processes (services, the DiT's ranks, every restart) as forks of one process that imported
    # torch, diffusers and transformers once (h3serve/common/forkserver.py): 10-12 s of CPU less per start, for about
    # 1 GiB of host memory that the children share
    fork_server: bool = True
    # the host's memory, GiB, that `h3serve plan` checks every process's private host memory against (less a reserve
    # for the OS); 0: the machine's MemTotal where the plan runs
    host_memory_gib: NonNegativeFloat = 0.0
    # each GPU's memory, GiB, that `h3serve plan` adds the processes on it up against (a card emulated on a bigger
    # one: its size); 0: the largest memory_limit_gib of the processes on that GPU
    gpu_memory_gib: NonNegativeFloat = 0.0

    @field_validator("max_backoff_s")
    @classmethod
    def _not_below_backoff(cls, limit: float, info: ValidationInfo) -> float:
        if "backoff_s" in info.data and limit < info.data["backoff_s"]:
            raise ValueError(f"must be at least backoff_s ({info.data['backoff_s']}), got {limit}")
        return limit


class DeployConfig(Section):
    encoder: EncoderConfig = Field(default_factory=lambda: EncoderConfig(port=50051))
    dit: DiTConfig = Field(default_factory=lambda: DiTConfig(port=50052))
    vae: VaeConfig = Field(default_factory=lambda: VaeConfig(port=50053))
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)

    def service(self, name: str):
        return getattr(self, name)


SERVICES = ("encoder", "dit", "vae")
# A `host` that listens on every interface: a client on the same machine reaches it on loopback.
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
SECTIONS = ("model", *SERVICES, "gateway", "supervisor")
SECTION_MODELS: dict[str, type[Section]] = {
    "model": ModelSection,
    "encoder": EncoderConfig,
    "dit": DiTConfig,
    "vae": VaeConfig,
    "gateway": GatewayConfig,
    "supervisor": SupervisorConfig,
}


def load_deploy(path: str | Path | None) -> DeployConfig:
    """Read a deployment file. `[model] dir` is the default model_dir of every model service; a stage address the
    gateway does not name is that service's host:port. ConfigError (a ValueError) lists what is wrong."""
    config = DeployConfig()
    if path is None:
        return config
    tables = _tables(path)
    shared = _checked(ModelSection(), tables["model"], f"{path} [model]").shared()
    services = {
        name: _checked(config.service(name), {**shared, **tables[name]}, f"{path} [{name}]") for name in SERVICES
    }
    stages = {name: service.address for name, service in services.items()}
    gateway = _checked(
        config.gateway, {**shared, **stages, **tables["gateway"], "deploy_file": str(path)}, f"{path} [gateway]"
    )
    supervisor = _checked(config.supervisor, tables["supervisor"], f"{path} [supervisor]")
    deploy = DeployConfig(gateway=gateway, supervisor=supervisor, **services)
    problems = _gateway_within_services(deploy)
    if problems:
        raise ConfigError("\n".join(f"{path} {problem}" for problem in problems))
    return deploy


# (gateway key, service, service key): the gateway admits what the service then checks again
SHARED_LIMITS = (
    ("max_prompt_chars", "encoder", "max_prompt_chars"),
    ("max_steps", "dit", "max_steps"),
    ("max_rows", "dit", "max_rows"),
)


def _gateway_within_services(deploy: DeployConfig) -> list[str]:
    """A gateway limit above its service's would accept requests the service refuses after they waited in a queue."""
    return [
        f"[gateway] {key} = {getattr(deploy.gateway, key):,} is above [{service}] {own} = "
        f"{getattr(deploy.service(service), own):,}: requests it admits would be refused by the {service}; lower "
        f"the gateway's or raise the {service}'s"
        for key, service, own in SHARED_LIMITS
        if getattr(deploy.gateway, key) > getattr(deploy.service(service), own)
    ]


def override(section, **flags):
    """Apply command-line flags that were given (not None) to one config section, checked like the file."""
    return _checked(section, {k: v for k, v in flags.items() if v is not None}, "command line")


def _tables(path: str | Path) -> dict[str, dict]:
    """Every known section of the file as a table ({} when absent); unknown sections are refused."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    problems = [
        f"{path} [{name}]: unknown section; known: {', '.join(SECTIONS)}" for name in data if name not in SECTIONS
    ]
    problems += [f"{path} [{name}]: should be a table" for name in SECTIONS if not isinstance(data.get(name, {}), dict)]
    if problems:
        raise ConfigError("\n".join(problems))
    return {name: data.get(name, {}) for name in SECTIONS}


S = TypeVar("S", bound=Section)


def _checked(section: S, changes: dict, where: str) -> S:
    try:
        return section.replace(**changes)
    except ValidationError as error:
        raise ConfigError(
            "\n".join(f"{where} {_describe(problem, type(section))}" for problem in error.errors())
        ) from None


def _describe(problem: ErrorDetails, model: type[Section]) -> str:
    """`key: what is wrong`, the key dotted into tables and lists ("capacity.t2va.768x1344", "workflows.0")."""
    key = ".".join(str(part) for part in problem["loc"] if part != "[key]")
    if problem["type"] == "extra_forbidden":
        owners = [
            f"[{name}]"
            for name, section in SECTION_MODELS.items()
            if section is not model and str(problem["loc"][-1]) in section.model_fields
        ]
        if owners and len(problem["loc"]) == 1:
            return f"{key}: not a key of this section; it belongs in {' or '.join(owners)}"
        close = difflib.get_close_matches(str(problem["loc"][-1]), model.model_fields, n=1)
        return f"{key}: unknown key" + (f"; did you mean {close[0]}?" if close else "")
    if problem["type"] == "value_error":  # our own checks: the message says it all
        return f"{key}: {problem['msg'].removeprefix('Value error, ')}"
    return f"{key}: {problem['msg']} (got {problem['input']!r})"
