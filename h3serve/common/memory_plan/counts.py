"""What the weights of each model weigh: parameter counts at the released sizes and bytes per parameter.

Counted on the meta device from diffusers' and transformers' classes (tests/test_plan.py counts them again); a
model directory with other sizes is not read. The sources of every number: docs/memory-plan.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from h3serve.common.config import (
    FILE_PARTITION,
    GGUF,
    DiTConfig,
    ModelServiceConfig,
)
from h3serve.model import workflows

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANT_BYTES = {"int8": 1.0, "nf4": 0.5625}  # per quantised weight; "none": the dtype's


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


def gib(nbytes: float) -> float:
    return nbytes / GIB


def on_gpu(service: ModelServiceConfig) -> bool:
    return service.device.split(":")[0] == "cuda"


def dit_weights(dit: DiTConfig) -> tuple[float, float]:
    """(every partition's weights, the largest block's) in bytes, each partition counted from the dtype and fp8, or
    a GGUF transformer_file's as the file holds it (kept quantised: the file's size, its blocks an equal share)."""
    partitions = {workflows.by_name(name).partition for name in dit.workflows}
    int8 = dit.weights == "int8"
    counted = TRANSFORMER.bytes(dit.dtype, dit.fp8, int8), TRANSFORMER.block_bytes(dit.dtype, dit.fp8, int8)
    gguf = gguf_bytes(dit)
    sizes = [
        (gguf, gguf / TRANSFORMER.blocks) if gguf is not None and partition == FILE_PARTITION else counted
        for partition in partitions
    ]
    return sum(total for total, _ in sizes), max(block for _, block in sizes)


def is_gguf(dit: DiTConfig) -> bool:
    return dit.transformer_file.lower().endswith(GGUF)


def gguf_bytes(dit: DiTConfig) -> float | None:
    """A GGUF transformer_file's size, None for none or when it is not on this machine."""
    if not is_gguf(dit):
        return None
    try:
        return float(os.path.getsize(dit.transformer_file))
    except OSError:
        return None


def file_gib(path: str) -> float:
    try:
        return gib(os.path.getsize(path))
    except OSError:
        return 0.0
