"""Checkpoint files users already have, written here from the tiny model: the published single-file layout (the
inverse of diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers`, qkv_layout="stacked") and GGUFs of
it (the `gguf` package's own quantiser: Q8_0 and Q4_0; it writes no k-quant such as Q4_K)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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


def to_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' transformer state dict in the published single-file layout: q, k, v stacked into one `qkv_proj`
    ([q; k; v] rows), the SwiGLU projection's halves swapped back to [gate; value], the original names."""
    published = {}
    for name, tensor in state.items():
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            parts = [state[name.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            name, tensor = name.replace(".attn.to_q.", ".attn.qkv_proj."), torch.cat(parts, dim=0)
        elif name.endswith(".ff.net.0.proj.weight"):
            value, gate = torch.chunk(tensor, 2, dim=0)  # diffusers' SwiGLU reads [value; gate]
            tensor = torch.cat([gate, value], dim=0)
        published[original_name(name)] = tensor.contiguous()
    return published


def write_single_file(
    model_dir: Path, path: Path, dtype: torch.dtype = torch.float32, extra: dict[str, torch.Tensor] | None = None
) -> Path:
    """The model directory's transformer as one published-layout safetensors file."""
    from safetensors.torch import load_file, save_file

    state = load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    published = {name: tensor.to(dtype) for name, tensor in to_published(state).items()}
    save_file({**published, **(extra or {})}, path)
    return path


def write_gguf(single_file: Path, path: Path, kind: str) -> Path:
    """`single_file` as a GGUF: every 2-D weight whose rows split into the type's blocks in `kind` ("Q8_0", "Q4_0"),
    the rest (norms, biases, the narrow linears) in F32, as the published GGUFs keep them."""
    import gguf
    from safetensors.torch import load_file

    quant = gguf.GGMLQuantizationType[kind]
    block, _ = gguf.GGML_QUANT_SIZES[quant]
    writer = gguf.GGUFWriter(str(path), arch="minimax_h3")
    for name, tensor in load_file(single_file).items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[1] % block == 0:
            data = gguf.quants.quantize(array, quant)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def truncated(path: Path, out: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    out.write_bytes(data[: int(len(data) * keep)])
    return out
