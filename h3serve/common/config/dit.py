"""[dit]: the DiT service's process group, its weights' form and placement, its adapters and its warm start. The
section that checks the most combinations, hence its own module."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
)

from h3serve.common.config.base import MAX_ROWS, MAX_STEPS, Steps, Workflows, parse_shape
from h3serve.common.config.model import Adapter, AdapterName
from h3serve.common.config.services import CompiledServiceConfig
from h3serve.model import rules

FLOAT16_REFUSED = (
    "float16 is refused for the MiniMax-H3 DiT: its activations pass float16's largest value (65504) "
    "and the video turns black; use bfloat16, and for fp16 tensor cores (sm_75) "
    'linear_precision = "fp16_scaled" (fp16 GEMMs that cannot overflow)'
)

# [dit] transformer_file: its formats, and the partition it replaces (h3serve/runtime/checkpoints.py loads it)
SAFETENSORS, GGUF = ".safetensors", ".gguf"
FILE_FORMATS = (SAFETENSORS, GGUF)
FILE_PARTITION = "transformer"


class DiTConfig(CompiledServiceConfig):
    """The DiT service: one process group of `world_size` ranks, started by h3serve's launcher on one node
    (h3serve/services/dit/supervisor.py) and by torchrun over several.

    Rank 0 hosts the gRPC server; every rank holds the transformer. See docs/deploy/sharded-dit.md.
    """

    workflows: Workflows = ("t2va", "fl2va", "ref2va")  # served workflows (decides the partitions loaded)
    world_size: PositiveInt = 1  # ranks in the group (all nodes together); 1 runs the same code path
    nnodes: PositiveInt = 1  # nodes; world_size / nnodes ranks start on each (above 1: through torchrun)
    rdzv_endpoint: str = ""  # multi-node: host:port of node 0's torchrun rendezvous (the node owning it is node 0)
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
    # instead of loading bf16 and quantising again (h3serve/runtime/quantised_store.py; ~44 GiB for the released model);
    # unfused adapters run over them. With offload = "group" the blocks are streamed from these files.
    fp8_cache_dir: str = ""
    # When a start that quantised writes the served fp8 weights to fp8_cache_dir (resident weights only: a streamed or
    # sharded start writes them before it goes on): "before_serving" holds health NOT_SERVING until they are written
    # (beside the warm-up), so no request runs under the save; "background" turns SERVING without waiting, and the
    # first requests share the machine with the save (h3serve/runtime/quantised_store.py)
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
