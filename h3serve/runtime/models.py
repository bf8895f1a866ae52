"""Where a service's components come from: the built-in tiny preset or a local model directory.

A model directory is the released diffusers layout (modular_model_index.json + one subfolder per
component); it is loaded through diffusers' own ModularPipeline loader, never from a hub.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3serve.model import presets
from h3serve.runtime import checkpoints, pinned, random_full, sharded_load, tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """`model_dir=None` selects the tiny preset; `presets.RANDOM_FULL` ("random:full") the released sizes with
    random weights, built on the device (benchmarks)."""

    model_dir: str | None = None
    transformer_file: str = ""  # `[dit] transformer_file`: the `transformer` partition from this file instead
    # (h3serve/runtime/checkpoints.py); the other components from model_dir

    @property
    def label(self) -> str:
        return self.model_dir or presets.TINY

    def revision(self) -> str:
        """Identifies the weights: part of every cache key derived from model outputs. Another transformer file is
        other weights: the caches keyed by the revision must not mix them."""
        file = checkpoints.fingerprint(self.transformer_file) if self.transformer_file else ""
        if self.model_dir is None:
            return presets.TINY_REVISION
        if self.model_dir == presets.RANDOM_FULL:
            return presets.RANDOM_FULL_REVISION + (f"-{hashlib.sha256(file.encode()).hexdigest()[:16]}" if file else "")
        digest = hashlib.sha256()
        root = Path(self.model_dir)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path.relative_to(root)}:{stat.st_size}".encode())
                if path.suffix == ".json":
                    digest.update(path.read_bytes())
        digest.update(file.encode())
        return "dir-" + digest.hexdigest()[:16]

    def load(self, names: list[str], device: str, dtype: str) -> dict[str, Any]:
        """Load the named pipeline components onto `device` in `dtype` (fp32-pinned modules stay fp32)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if self.model_dir == presets.RANDOM_FULL:  # built on the device; a transformer_file's partition read from it
            built = random_full.build([name for name in names if not self.from_file(name)], device, DTYPES[dtype])
            files = {name: self._from_file(DTYPES[dtype]) for name in names if self.from_file(name)}
            return drop_unread_parts({**built, **self._placed(files, device)})
        if self.model_dir is None:
            if dtype != "float32":
                raise ValueError("the tiny preset is built in float32 only; use a model directory for other dtypes")
            return self._placed({name: tiny.build_component(name) for name in names}, device, own=False)
        return self._placed(drop_unread_parts(self._load_dir(names, DTYPES[dtype])), device)

    @staticmethod
    def _placed(components: dict[str, Any], device: str, own: bool = True) -> dict[str, Any]:
        """`components`' modules moved to `device`; loaded ones on the CPU in memory of their own (own_memory)."""
        for value in components.values():
            if isinstance(value, torch.nn.Module):
                value.to(device)
                if own and torch.device(device).type == "cpu":
                    own_memory(value)
        return components

    def weights(self, name: str) -> sharded_load.Weights:
        """Where a rank reads its shards of model component `name` from (h3serve/runtime/sharded_load.py)."""
        if self.model_dir is None:
            raise ValueError("the tiny preset is built whole (its seeded values come from the full modules)")
        if self.model_dir == presets.RANDOM_FULL:
            return sharded_load.RandomWeights(name)
        if self.from_file(name):
            raise ValueError(
                f"{name} comes from transformer_file {self.transformer_file!r}, which is loaded whole: "
                "a rank's shards and the fp8 store's blocks are read from the released layout's files"
            )
        return sharded_load.Checkpoint.open(Path(self.model_dir) / name)

    def _load_dir(self, names: list[str], dtype: torch.dtype) -> dict[str, Any]:
        from diffusers.modular_pipelines import ModularPipeline

        model_dir = self.model_dir
        assert model_dir is not None  # load() builds the tiny preset without one
        if not os.path.isfile(os.path.join(model_dir, "modular_model_index.json")):
            raise FileNotFoundError(f"{model_dir} has no modular_model_index.json (not a diffusers model dir)")
        pipe = ModularPipeline.from_pretrained(model_dir)
        released = [name for name in names if not self.from_file(name)]
        if released:
            for name in released:  # the start log names every weight file it loads
                for file in checkpoints.weight_files(Path(model_dir) / name):
                    checkpoints.log.info("loading %s from %s", name, checkpoints.describe_weight_file(file))
            pipe.load_components(names=released, dtype=dtype)
        return {name: self._from_file(dtype) if self.from_file(name) else getattr(pipe, name) for name in names}

    def _from_file(self, dtype: torch.dtype) -> torch.nn.Module:
        assert self.model_dir is not None  # the config refuses a transformer_file without [model] dir
        return checkpoints.load(self.transformer_file, self.model_dir, dtype)

    def from_file(self, name: str) -> bool:
        return bool(self.transformer_file) and name == checkpoints.PARTITION


def drop_unread_parts(components: dict[str, Any]) -> dict[str, Any]:
    """`components`, with what the pipeline never reads of a text encoder freed before it reaches a device (the
    tiny preset's is left whole, as the reference pipeline builds it): the pipeline conditions on the hidden state
    after decoder layer 50 (diffusers' `text_encoder_layer`) of `text_encoder.model`, so the layers above the
    51st and the language-model head cannot change an output. Released Qwen3-VL-32B: 13 of 64 layers (6.3 B
    parameters) and the head (0.8 B), of 33.4 B."""
    text_encoder = components.get("text_encoder")
    if text_encoder is None:
        return components
    layers = text_encoder.model.language_model.layers
    if len(layers) > presets.TEXT_ENCODER_LAYERS:
        text_encoder.model.language_model.layers = layers[: presets.TEXT_ENCODER_LAYERS]
        text_encoder.config.text_config.num_hidden_layers = presets.TEXT_ENCODER_LAYERS
    text_encoder.lm_head = torch.nn.Identity()
    return components


def own_memory(module: torch.nn.Module) -> None:
    """Copy memory-mapped checkpoint tensors into fresh allocations.

    CPU BLAS kernels pick their code path by pointer alignment, so weights read in place from a
    safetensors file gave results a few ulp away from the same weights built in memory.
    """
    pinned.replace_tensors(module, torch.Tensor.clone)
