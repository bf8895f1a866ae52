"""Tiny random LoRA files for the tiny transformer, made in the tests themselves, in the formats diffusers reads.

- `diffusers_lora`: diffusers' own layout (`save_lora_weights`), its peft config (rank, lora_alpha) in the file's
  `lora_adapter_metadata`; `partition="transformer_ref"` writes a `transformer_ref.`-prefixed file (ref2va).
- `original_lora`: MiniMax-H3's original module names (fused `attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`/`fc2`,
  `final_layer.video_out`), either kohya's (`lora_down`/`lora_up` with per-module `.alpha` scalars) or ai-toolkit's
  (`diffusion_model.` prefix, `lora_A`/`lora_B`, a `__metadata__` `alpha`). DiffSynth's variant is not made: its
  conversion hard-codes a 128-wide head, and the tiny model's is 16.
- `manual_merge`: a transformer with a file merged into its weights by hand, at alpha / rank x weight, without
  diffusers: the yardstick for "alpha is honoured". Of an original file it reads only the modules whose names map
  one to one (`ONE_TO_ONE`, `FINAL`), which `original_lora(..., fused=False)` limits itself to.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HIDDEN, FFN, VIDEO_OUT = 32, 64, 96  # the tiny transformer's widths (h3serve/model/presets.py TINY_TRANSFORMER)
# original name -> (diffusers name, in features, out features); one to one, so a manual merge needs no conversion
ONE_TO_ONE = {
    "blocks.{i}.attn.out_proj": ("transformer_blocks.{i}.attn.to_out.0", HIDDEN, HIDDEN),
    "blocks.{i}.mlp.fc2": ("transformer_blocks.{i}.ff.net.2", FFN, HIDDEN),
}
FINAL = {"final_layer.video_out": ("proj_out", HIDDEN, VIDEO_OUT)}
FUSED = {"blocks.{i}.attn.qkv_proj": (None, HIDDEN, 3 * HIDDEN), "blocks.{i}.mlp.fc1": (None, HIDDEN, 2 * FFN)}
LAYERS = 2
FACTOR_STD = 0.1  # a LoRA's change stays small next to the weights (about 0.1 here), as a trained one's does


def _modules(fused: bool) -> dict[str, tuple]:
    per_block = {**ONE_TO_ONE, **(FUSED if fused else {})}
    out = {
        name.format(i=i): (target and target.format(i=i), fan_in, fan_out)
        for name, (target, fan_in, fan_out) in per_block.items()
        for i in range(LAYERS)
    }
    return {**out, **FINAL}


def original_lora(
    path: Path,
    seed: int,
    rank: int,
    alpha: float,
    style: str = "kohya",
    fused: bool = True,
    sidecar: dict | None = None,
) -> Path:
    """A random LoRA in an original MiniMax-H3 layout: `style` "kohya" (per-module .alpha) or "aitk" (metadata)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (_, fan_in, fan_out) in _modules(fused).items():
        down = torch.randn(rank, fan_in, generator=generator) * FACTOR_STD
        up = torch.randn(fan_out, rank, generator=generator) * FACTOR_STD
        if style == "kohya":
            tensors.update(
                {
                    f"{name}.lora_down.weight": down,
                    f"{name}.lora_up.weight": up,
                    f"{name}.alpha": torch.tensor(float(alpha)),
                }
            )
        else:
            tensors.update({f"diffusion_model.{name}.lora_A.weight": down, f"diffusion_model.{name}.lora_B.weight": up})
    save_file(tensors, str(path), metadata=None if style == "kohya" else {"alpha": str(alpha)})
    return _with_sidecar(path, sidecar)


def diffusers_lora(
    directory: Path,
    seed: int,
    rank: int,
    alpha: float,
    partition: str = "transformer",
    targets: tuple[str, ...] = ("to_q", "to_v", "ff.net.2", "proj_out"),
    sidecar: dict | None = None,
) -> Path:
    """A random LoRA on the tiny transformer, saved by diffusers (`save_lora_weights`) with its peft config."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
    from peft import LoraConfig, get_peft_model_state_dict

    from h3serve.runtime.tiny import build_component

    torch.manual_seed(seed)  # peft draws the factors from the global generator (init_lora_weights=False)
    model = build_component("transformer")
    model.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False), adapter_name="x"
    )
    layers, config = get_peft_model_state_dict(model, adapter_name="x"), model.peft_config["x"].to_dict()
    MiniMaxH3LoraLoaderMixin.save_lora_weights(
        directory, **{f"{partition}_lora_layers": layers, f"{partition}_lora_adapter_metadata": config}
    )
    return _with_sidecar(Path(directory) / "pytorch_lora_weights.safetensors", sidecar)


def _with_sidecar(path: Path, sidecar: dict | None) -> Path:
    if sidecar is not None:
        path.with_suffix(".json").write_text(json.dumps(sidecar))
    return path


def factors(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{diffusers module name: (down, up)} of a diffusers file or of an original one's one-to-one modules."""
    tensors = {k.removeprefix("diffusion_model."): v for k, v in load_file(str(path)).items()}
    if any(k.startswith("transformer.") for k in tensors):
        return {
            k.removeprefix("transformer.").removesuffix(".lora_A.weight"): (v, tensors[k.replace("lora_A", "lora_B")])
            for k, v in tensors.items()
            if k.endswith("lora_A.weight")
        }
    return {
        target: (
            tensors.get(f"{name}.lora_down.weight", tensors.get(f"{name}.lora_A.weight")),
            tensors.get(f"{name}.lora_up.weight", tensors.get(f"{name}.lora_B.weight")),
        )
        for name, (target, _, _) in _modules(fused=False).items()
    }


def manual_merge(transformer: torch.nn.Module, path: Path, scale: float) -> torch.nn.Module:
    """`transformer` with W += scale * up @ down for each module of the file (`scale` = the alpha / rank the file was
    written with, times a request's weight), in place; returns it."""
    modules = dict(transformer.named_modules())
    with torch.no_grad():
        for target, (down, up) in factors(path).items():
            modules[target].weight += scale * (up @ down)
    return transformer
