"""`[dit] transformer_file` at the DiT's start: the file must load (runtime/checkpoints.py), and the options that
cannot apply to it are refused here, with the reason, before any weight reaches a GPU.

The file replaces the `transformer` partition (t2va, fl2va) only: `transformer_ref` (ref2va) still loads from the
model directory's released layout, as no published single file holds it.

A safetensors file holds plain weights: everything applies but what reads the released layout's files directly
(the fp8 store; FSDP's per-rank shard loading, replaced by a whole load, then sharding). A GGUF keeps its weights
quantised (diffusers' GGUFLinear dequantises each as it runs), which rules out more: fp8, FSDP, a fused adapter and
compile. What does apply to it: unfused adapters (peft's LoRA layers wrap the GGUF linears and add their branch to
what they compute) and group offload (the quantised bytes pinned in host memory and streamed block by block).
"""

from __future__ import annotations

from h3serve.common.config import DiTConfig
from h3serve.model.adapters import FUSED
from h3serve.runtime import checkpoints


def check(config: DiTConfig) -> None:
    """checkpoints.CheckpointRefused (a ValueError) naming the file and the reason."""
    if not config.transformer_file:
        return
    path = config.transformer_file
    if config.fp8_cache_dir:
        raise checkpoints.CheckpointRefused(
            path,
            "fp8_cache_dir saves and streams the transformer from the model "
            'directory\'s released files, not this one: set fp8_cache_dir = ""',
        )
    checkpoints.check(path, config.model_dir)
    if checkpoints.is_gguf(path):
        refused = gguf_refusals(config)
        if refused:
            raise checkpoints.CheckpointRefused(path, f"a GGUF's weights stay quantised, so {refused[0]}")


def gguf_refusals(config: DiTConfig) -> list[str]:
    """What the configured fast path cannot do over GGUF linears, each with its way out."""
    refused = []
    if config.fp8:
        refused.append(
            "fp8 = true cannot re-quantise them (it quantises bf16 linears): set fp8 = false, or serve a "
            "bf16 .safetensors file with fp8"
        )
    if config.fsdp and config.world_size > 1:
        refused.append(
            "fsdp = true cannot shard them (FSDP2 flattens plain tensors): replicate (fsdp = false) or "
            "serve a .safetensors file"
        )
    if config.adapters and config.adapter_mode == FUSED:
        refused.append('adapter_mode = "fused" cannot merge an adapter into them: set adapter_mode = "unfused"')
    if config.compile:
        refused.append("compile = true is untested over diffusers' GGUF linears here: set compile = false")
    return refused
