"""[encoder] and [vae], and what every model service process takes (`ModelServiceConfig`) or every service that
runs diffusers' blocks on the fast path (`CompiledServiceConfig`, also the DiT's base: h3serve/common/config/dit.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationInfo, field_validator

from h3serve.common.config.base import MAX_PROMPT_CHARS, DType, Port, Section
from h3serve.model.rules import Geometry


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
    # all but rarely (docs/performance.md); threaded encodes of identical frames differed 3 times in ~140 under load
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
    # With quantize = "int8" and cpu_offload or spread: the int8 weights saved here, a file per decoder layer, at the
    # first start and assigned at later ones, memory-mapped, instead of quantising again (25.7 GiB for the released
    # encoder; h3serve/runtime/quantised_store.py). Needs [model] dir (or random:full): refused at start for the
    # tiny preset, which is built whole
    int8_cache_dir: str = ""

    @field_validator("cpu_offload")
    @classmethod
    def _one_placement(cls, offload: bool, info: ValidationInfo) -> bool:
        if offload and info.data.get("spread"):
            raise ValueError("spread and cpu_offload are two placements of the same layers: choose one")
        return offload

    @field_validator("int8_cache_dir")
    @classmethod
    def _int8_to_cache(cls, directory: str, info: ValidationInfo) -> str:
        if directory and info.data.get("quantize") != "int8":
            raise ValueError('int8_cache_dir keeps the int8-quantized weights: it needs quantize = "int8"')
        if directory and not (info.data.get("cpu_offload") or info.data.get("spread")):
            raise ValueError(
                "int8_cache_dir keeps the encoder quantized layer by layer, as cpu_offload and spread build it: set "
                'one of them, or int8_cache_dir = "" (a resident int8 encoder is quantized whole)'
            )
        return directory
