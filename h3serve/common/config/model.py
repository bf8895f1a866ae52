"""[model] (the model directory and the geometry every section shares) and the `[dit] adapters` entries: where
the model's files come from, and the LoRA files checked with their sidecars when the file is read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, PositiveInt

from h3serve.common.config.base import Section
from h3serve.model import adapters as adapter_rules
from h3serve.model.rules import Geometry


class ModelSection(Section):
    """[model]: the model directory and the pipeline geometry (Geometry's keys) that every section shares."""

    dir: str = ""  # empty: the built-in tiny preset
    canvas_short_edge: PositiveInt = Geometry.canvas_short_edge
    canvas_max_pixels: PositiveInt = Geometry.canvas_max_pixels
    reference_image_short_edge: PositiveInt = Geometry.reference_image_short_edge

    def shared(self) -> dict:
        """The fields every section takes from [model]."""
        return {"model_dir": self.dir, "geometry": Geometry(**self.model_dump(exclude={"dir"}))}


class AdapterSource(Section):
    """One `[dit] adapters` entry: a LoRA file (diffusers' layout or an original MiniMax-H3 one, converted by
    diffusers), given as its path or as a table. Its sidecar JSON (same stem, `.json`) is checked with it."""

    path: str
    transformer_ref: bool = False  # diffusers' load_into_transformer_ref: a `transformer.`-prefixed (or original)
    # file goes into the ref2va partition instead of the t2va/fl2va one


def _adapter_source(value):
    return {"path": value} if isinstance(value, str) else value


def _adapter_file(source: AdapterSource) -> AdapterSource:
    if not Path(source.path).is_file():
        raise ValueError(f"no such file: {source.path}")
    if Path(source.path).suffix != ".safetensors":
        raise ValueError(f"must be a .safetensors file (pickled checkpoints are not loaded), got {source.path}")
    adapter_rules.read_sidecar(source.path)
    return source


def _adapter_name(name: str) -> str:
    if not adapter_rules.NAME.fullmatch(name):
        raise ValueError(f"an adapter name is {adapter_rules.NAME_RULE}, got {name!r}")
    return name


AdapterName = Annotated[str, AfterValidator(_adapter_name)]
Adapter = Annotated[AdapterSource, BeforeValidator(_adapter_source), AfterValidator(_adapter_file)]
