"""Materialise a meta-device FSDP2 module rank by rank: only this rank's shards, from safetensors files or random.

A rank builds the model on the meta device (`random_full.skeleton`: no weight memory), FSDP2 shards it
(h3serve/services/dit/parallel.py), and only then allocates parameters: this rank's Shard(0) rows of each
(`materialise`), on the device, or in host memory with FSDP2's CPU offload. Each parameter is filled on its
own, so besides the shards a rank holds at most one parameter's rows in transit:

- `Checkpoint`: a component folder of a model directory; the rows are read from the memory-mapped
  safetensors file, which is opened per tensor so the pages it maps never add up to more than one tensor.
- `RandomWeights`: `random:full` (benchmarks), seeded values drawn for this rank's rows only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from h3serve.runtime import random_full

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class LocalRows:
    """This rank's part of one parameter. FSDP2's Shard(0) splits like torch.chunk: rank r holds rows
    [r * ceil(n / world), ...), fewer on the last ranks."""

    tensor: torch.Tensor  # the local shard: writing it writes what FSDP2 gathers
    start: int  # its first row in the whole parameter
    shape: torch.Size  # the whole parameter's

    @classmethod
    def of(cls, param: DTensor) -> LocalRows:
        from torch.distributed.tensor import Shard

        if param.placements != (Shard(0),):
            raise ValueError(f"expected FSDP2's Shard(0) placement, got {param.placements}")
        mesh = param.device_mesh
        chunk = -(-param.shape[0] // mesh.size())
        return cls(param.to_local(), mesh.get_local_rank() * chunk, param.shape)


class Weights(Protocol):
    """Where a component's values come from: the module to build, and each parameter's rows."""

    @property
    def label(self) -> str: ...

    def factory(self) -> torch.nn.Module: ...

    def fill(self, name: str, rows: LocalRows) -> None: ...


WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")  # diffusers' and transformers' names


@dataclass(frozen=True)
class Checkpoint:
    """A component folder in diffusers' layout: config.json and one safetensors file, or shards named by an index
    (a diffusers model's, or a transformers one's, such as the text encoder)."""

    folder: Path
    files: dict[str, Path]  # tensor name -> the file holding it

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint:
        from safetensors import safe_open

        folder = Path(folder)
        for name in WEIGHT_FILES:
            index = folder / f"{name}.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return cls(folder, {tensor: folder / file for tensor, file in weight_map.items()})
            single = folder / name
            if single.is_file():
                with safe_open(single, framework="pt") as f:
                    return cls(folder, dict.fromkeys(f.keys(), single))
        raise FileNotFoundError(f"{folder} has none of {', '.join(WEIGHT_FILES)} (or their .index.json)")

    @property
    def label(self) -> str:
        return str(self.folder)

    def factory(self) -> torch.nn.Module:
        config = json.loads((self.folder / "config.json").read_text())
        if "_class_name" in config:  # a diffusers model
            import diffusers

            model_class = getattr(diffusers, config["_class_name"])
            return model_class.from_config(model_class.load_config(str(self.folder)))
        import transformers

        model_class = getattr(transformers, config["architectures"][0])
        return model_class(transformers.AutoConfig.from_pretrained(str(self.folder)))

    def fill(self, name: str, rows: LocalRows) -> None:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        with safe_open(self.files[name], framework="pt") as f:  # closed per tensor: its mapped pages go with it
            rows.tensor.copy_(f.get_slice(name)[rows.start : rows.start + rows.tensor.shape[0]])


@dataclass(frozen=True)
class RandomWeights:
    """random:full's values (`random_full.fill`), each rank drawing only its rows, seeded by the component, the
    parameter and the first row: the same model on every start of the same layout."""

    component: str

    @property
    def label(self) -> str:
        return f"random ({self.component})"

    def factory(self) -> torch.nn.Module:
        return random_full.model_factory(self.component)()

    def fill(self, name: str, rows: LocalRows) -> None:
        random_full.fill(rows.tensor, self.component, name, rows.start, rows.shape)


def materialise(model: torch.nn.Module, weights: Weights, device: torch.device, offload: bool) -> None:
    """Allocate this rank's shards of the FSDP2-sharded skeleton (in host memory with `offload`, else on `device`)
    and fill them from `weights`; the buffers built with the skeleton are kept, on `device`."""
    buffers = dict(model.named_buffers())
    model.to_empty(device="cpu" if offload else device)  # FSDP2 re-registers (and pads, pins) its shards
    for name, buffer in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, buffer.to(device))
    with torch.no_grad():
        for name, param in model.named_parameters():
            weights.fill(name, LocalRows.of(cast("DTensor", param)))  # FSDP2's


def shard_bytes(model: torch.nn.Module) -> int:
    """The bytes of this rank's shards."""
    return sum(cast("DTensor", p).to_local().nbytes for p in model.parameters())  # FSDP2's


@torch.no_grad()
def fill_module(module: torch.nn.Module, weights: Weights, prefix: str, device: torch.device) -> None:
    """Materialise `module` (a part of a skeleton named `prefix` in it, parameters on meta) whole on `device`, its
    values from `weights`; the buffers built with the skeleton are kept. Parameters already materialised stay."""
    for owner_name, owner in module.named_modules():
        for attribute, param in list(owner.named_parameters(recurse=False)):
            if param.is_meta:
                values = torch.empty(param.shape, dtype=param.dtype, device=device)
                name = f"{owner_name}.{attribute}" if owner_name else attribute
                weights.fill(prefix + name, LocalRows(values, 0, param.shape))
                owner._parameters[attribute] = torch.nn.Parameter(values, param.requires_grad)
        for attribute, buffer in list(owner.named_buffers(recurse=False)):
            owner._buffers[attribute] = buffer.to(device)
