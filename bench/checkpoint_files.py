"""Checkpoint files users already have, written from a transformer's weights: the published single-file layout (the
inverse of diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers`, qkv_layout="stacked") and GGUFs of
it, Q8_0 and Q4_0 (the `gguf` package writes no k-quant such as Q4_K).

Two GGUF writers: `write_gguf` (the tests' tiny model, through the `gguf` package's numpy quantiser) and
`stream_gguf` (the released size, bench/gguf_step.py: 33e9 weights on a GPU, quantised there by `quantize`, which
gives gguf's bytes exactly, and written one tensor at a time, so host memory holds one tensor, not the 35 GB file).

As a command, the released-size transformer with random weights (`[model] dir = "random:full"`'s, built in bf16 on
the GPU) written as a GGUF, for a benchmark to serve as `[dit] transformer_file` (bench.e2e --transformer-file):

    python -m bench.checkpoint_files Q4_0 /root/h3-Q4_0.gguf
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

ARCH = "minimax_h3"  # the GGUF's general.architecture
BLOCK = 32  # values per block of Q8_0 and Q4_0 (gguf.GGML_QUANT_SIZES)

# diffusers' MINIMAX_H3_KEYS_RENAME_DICT reversed. Order matters: a longer name first where one contains another
# ("audio_proj_in." contains "proj_in.", "audio_proj_out." contains "proj_out.").
TO_ORIGINAL = (
    ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("audio_proj_in.", "audio_patch_proj."),
    ("audio_proj_out.", "final_layer.audio_out."),
    ("context_embedder.", "condition_proj."),
    ("norm_out.norm.", "final_layer.norm."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    (".attn.norm_q.", ".attn.q_norm."),
    (".attn.norm_k.", ".attn.k_norm."),
    (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."),
    (".ff.net.2.", ".mlp.fc2."),
)
TOP_LEVEL = (
    ("proj_in.", "video_patch_proj."),
    ("proj_out.", "final_layer.video_out."),
    ("transformer_blocks.", "blocks."),
)


def original_name(name: str) -> str:
    for prefix, original in TOP_LEVEL:
        if name.startswith(prefix):
            name = original + name[len(prefix) :]
    for diffusers_part, original in TO_ORIGINAL:
        name = name.replace(diffusers_part, original)
    return name


def published(state: Mapping[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """diffusers' transformer state dict in the published single-file layout, each tensor by its original name and
    made only when called (a writer of the released size holds one at a time): q, k, v stacked into one `qkv_proj`
    ([q; k; v] rows), the SwiGLU projection's halves swapped back to [gate; value]."""
    layout: dict[str, Callable[[], torch.Tensor]] = {}
    for name, tensor in state.items():
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            parts = [state[name.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            layout[original_name(name.replace(".attn.to_q.", ".attn.qkv_proj."))] = partial(torch.cat, parts, dim=0)
        elif name.endswith(".ff.net.0.proj.weight"):
            layout[original_name(name)] = partial(_gate_first, tensor)
        else:
            layout[original_name(name)] = tensor.contiguous
    return layout


def _gate_first(tensor: torch.Tensor) -> torch.Tensor:
    value, gate = torch.chunk(tensor, 2, dim=0)  # diffusers' SwiGLU reads [value; gate]
    return torch.cat([gate, value], dim=0)


def to_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`published(state)` made, every tensor at once."""
    return {name: make() for name, make in published(state).items()}


def write_single_file(
    model_dir: Path, path: Path, dtype: torch.dtype = torch.float32, extra: dict[str, torch.Tensor] | None = None
) -> Path:
    """The model directory's transformer as one published-layout safetensors file."""
    from safetensors.torch import load_file, save_file

    state = load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    weights = {name: tensor.to(dtype) for name, tensor in to_published(state).items()}
    save_file({**weights, **(extra or {})}, path)
    return path


def quantised(shape: Sequence[int], quant: GGMLQuantizationType) -> bool:
    """Whether a GGUF of the published layout holds this tensor in `quant`: 2-D weights whose rows split into its
    blocks; the rest (norms, biases, the narrow linears) stay F32, as the published GGUFs keep them."""
    import gguf

    return len(shape) == 2 and shape[1] % gguf.GGML_QUANT_SIZES[quant][0] == 0


def write_gguf(single_file: Path, path: Path, kind: str) -> Path:
    """`single_file` as a GGUF, the `quantised` tensors in `kind` ("Q8_0", "Q4_0") by the gguf package's quantiser."""
    import gguf
    from safetensors.torch import load_file

    quant = gguf.GGMLQuantizationType[kind]
    writer = gguf.GGUFWriter(str(path), arch=ARCH)
    for name, tensor in load_file(single_file).items():
        array = tensor.float().numpy()
        if quantised(array.shape, quant):
            data = gguf.quants.quantize(array, quant)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stream_gguf(state: Mapping[str, torch.Tensor], path: Path, kind: str) -> Path:
    """diffusers' transformer state dict `state` (on any device) as a GGUF of the published layout, the `quantised`
    tensors in `kind` by `quantize` on their device: the tensors as `write_gguf` writes them.

    gguf's own way (`add_tensor`, then write) keeps every array in host memory until the end: the whole 35 GB file
    at the released size. Here every tensor is declared first, its shape found by making the layout on meta tensors,
    then the header and the declarations are written, and each tensor is made, quantised and written in turn."""
    import gguf

    quant = gguf.GGMLQuantizationType[kind]
    writer = gguf.GGUFWriter(str(path), arch=ARCH)
    for name, make in published({key: value.to("meta") for key, value in state.items()}).items():
        shape = tuple(make().shape)
        if quantised(shape, quant):
            stored = gguf.quant_shape_to_byte_shape(shape, quant)  # as add_tensor declares gguf's quantised arrays
            writer.add_tensor_info(name, stored, np.dtype(np.uint8), math.prod(stored), raw_dtype=quant)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for make in published(state).values():  # in the order declared: the writer takes the declarations in turn
        tensor = make()
        data = quantize(tensor, kind) if quantised(tensor.shape, quant) else tensor.float()
        writer.write_tensor_data(data.cpu().numpy())
    writer.close()
    return path


def quantize(weights: torch.Tensor, kind: str) -> torch.Tensor:
    """`weights` (rows of a multiple of 32 values) in GGUF `kind` ("Q8_0", "Q4_0") on their own device: the bytes
    `gguf.quants.quantize` gives (uint8, one row of blocks per row), by its numpy code step for step in float32: the
    scale from the block's maximum, its reciprocal taken as 0 for an all-zero block, each block's fp16 scale first.
    The divisors are tensors, not Python numbers: CUDA divides by a Python number as a product with its reciprocal,
    one bit off numpy's division."""
    blocks = weights.float().reshape(-1, BLOCK)
    scale, values = QUANTISERS[kind](blocks)
    packed = torch.cat([scale.to(torch.float16).view(torch.uint8), values], dim=1)
    return packed.reshape(*weights.shape[:-1], -1)


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale max|x| / 127 and x / scale rounded half away from zero (gguf's np_roundf), as int8."""
    scale = blocks.abs().amax(dim=1, keepdim=True) / blocks.new_tensor(127.0)
    scaled = blocks * _reciprocal(scale)
    magnitude = scaled.abs()
    whole = magnitude.floor()
    rounded = scaled.sign() * (whole + (2 * (magnitude - whole)).floor())
    return scale, rounded.to(torch.int8).view(torch.uint8)


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale m / -8 of the block's value of largest magnitude m (its first, signed), then x / scale + 8.5
    truncated to 0..15; byte j holds value j in its low nibble and value j + 16 in its high one."""
    largest = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    scale = largest / blocks.new_tensor(-8.0)
    nibbles = torch.trunc(blocks * _reciprocal(scale) + 8.5).to(torch.uint8).clamp(0, 15)
    half = BLOCK // 2
    return scale, nibbles[:, :half] | (nibbles[:, half:] << 4)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, 0.0, torch.ones_like(scale) / scale)


QUANTISERS = {"Q8_0": _q8_0, "Q4_0": _q4_0}  # each: float32 blocks -> (float32 scales, the blocks' value bytes)


def truncated(path: Path, out: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    out.write_bytes(data[: int(len(data) * keep)])
    return out


def main(argv: list[str] | None = None) -> Path:
    import argparse
    import time

    from h3serve.runtime import random_full

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=tuple(QUANTISERS))
    parser.add_argument("path", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    transformer = random_full.build_component("transformer", args.device, torch.bfloat16)
    stream_gguf(transformer.state_dict(), args.path, args.kind)
    size = args.path.stat().st_size
    print(f"{args.path}: {args.kind}, {size / 2**30:.2f} GiB, written in {time.perf_counter() - started:.1f} s")
    return args.path


if __name__ == "__main__":
    main()
