"""Measures the int8 text encoder's embedding error against the unquantized one, on the CPU (the table in
h3serve/services/encoder/placement.py's docstring).

    python -m bench.encoder_int8                  # the tiny preset (fp32)
    python -m bench.encoder_int8 1024 2048 51     # random Qwen3-VL: hidden, MLP, layers (fp32, bf16)

The random encoder has head_dim 64, hidden/64 heads and hidden/256 key-value heads, the tiny preset's byte-level
tokenizer and vision tower, and is seeded like the tiny preset's. Nothing is downloaded.
"""

from __future__ import annotations

import sys
import time

import torch

from h3serve.services.encoder import placement

PROMPT = "a quiet harbour at dawn, gulls circling over fishing boats while a bell rings in the distance"


def random_text_encoder(hidden: int, intermediate: int, layers: int) -> torch.nn.Module:
    from transformers import Qwen3VLForConditionalGeneration

    from h3serve.model import presets
    from h3serve.runtime import tiny

    tokenizer = presets.tiny_tokenizer()
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [16, 8, 8],
            "mrope_interleaved": True,
        },
    }
    config = tiny.qwen3_vl_config(tokenizer, text, presets.TINY_TEXT_ENCODER_VISION)
    tiny.seeded("text_encoder")
    return Qwen3VLForConditionalGeneration(config).eval()


def components(text_encoder: torch.nn.Module | None = None) -> dict:
    from h3serve.runtime import tiny

    return {
        "text_encoder": text_encoder if text_encoder is not None else tiny.build_component("text_encoder"),
        "tokenizer": tiny.build_component("tokenizer"),
        "processor": tiny.build_component("processor"),
    }


def embed(parts: dict, prompt: str = PROMPT) -> torch.Tensor:
    from h3serve.services.encoder.runner import TextEncoderRunner
    from h3serve.v1 import common_pb2

    return TextEncoderRunner(parts).encode(prompt, common_pb2.WORKFLOW_T2VA)["prompt_embeds"].clone()


def report(label: str, quantized: torch.Tensor, reference: torch.Tensor) -> None:
    max_abs, rel = placement.embedding_error(quantized, reference)
    peak = reference.float().abs().max().item()
    print(
        f"{label}: max abs {max_abs:.2e} ({100 * max_abs / peak:.1f} % of max |ref| {peak:.3g}), "
        f"relative L2 {rel:.2e}, within the bound: {placement.INT8_BOUND.holds(quantized, reference)}",
        flush=True,
    )


def measure(build, dtypes=(torch.float32,)) -> None:
    fp32_reference = None
    for dtype in dtypes:
        started = time.perf_counter()
        parts = components(build())
        parts["text_encoder"].to(dtype)
        reference = embed(parts)
        if dtype == torch.float32:
            fp32_reference = reference
        elif fp32_reference is not None:
            report(f"unquantized {str(dtype).removeprefix('torch.')} vs float32 (for scale)", reference, fp32_reference)
        placement.quantize_in_place(parts["text_encoder"], "int8", dtype, None)
        report(
            f"int8 vs unquantized, {str(dtype).removeprefix('torch.')}, {reference.shape[1]} tokens",
            embed(parts),
            reference,
        )
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)


def main(argv: list[str]) -> None:
    torch.manual_seed(0)
    if not argv:
        from h3serve.runtime import tiny

        measure(lambda: tiny.build_component("text_encoder"))
    else:
        hidden, intermediate, layers = map(int, argv)
        measure(lambda: random_text_encoder(hidden, intermediate, layers), (torch.float32, torch.bfloat16))


if __name__ == "__main__":
    main(sys.argv[1:])
