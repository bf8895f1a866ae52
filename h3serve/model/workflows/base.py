"""What a MiniMax-H3 workflow is to h3serve: one object per workflow that owns everything workflow-specific.

Gateway side (torch-free): which request fields carry its media, how they resolve against the stored
assets (kinds, counts, canvas), which prompt labels they make, the packed rows they cost and the media
items the stages receive. Stage side: diffusers' own blocks for each stage (set-up, text encoder,
VAE encode, core denoise) and the DiT's conditioning inputs. Stage-side methods import diffusers when
called, so the gateway can hold the registry without loading torch. A new workflow is one module
beside t2va.py, fl2va.py and ref2va.py, listed in this package's registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from h3serve.model.rules import Geometry, InvalidRequest, Rows
from h3serve.v1 import common_pb2, dit_pb2, gateway_pb2, media_pb2

AssetLookup = Callable[[str], gateway_pb2.Asset | None]

# The stages a job passes, in order; stages in one tuple run at the same time.
Plan = tuple[tuple[str, ...], ...]
T2VA_PLAN = (("encoder",), ("dit",), ("vae",))
WITH_MEDIA_PLAN = (("encoder", "vae-encode"), ("dit",), ("vae",))


class MediaError(ValueError):
    """A media stream or asset a stage cannot turn into the model's inputs."""


def kind_name(kind: int) -> str:
    """The kind's lower-case name: image, video or audio."""
    return media_pb2.AssetKind.Name(kind).removeprefix("ASSET_KIND_").lower()


def find_asset(assets: AssetLookup, field: str, asset_id: str) -> gateway_pb2.Asset:
    asset = assets(asset_id)
    if asset is None:
        raise InvalidRequest(field, f"no asset {asset_id!r}; upload the file with UploadAsset and pass its asset_id")
    return asset


@dataclass(frozen=True)
class ModelDims:
    """The widths of the loaded model's tensors that a request's tensors must have (its transformer's config)."""

    text_dim: int  # prompt_embeds (1, N, text_dim)
    latent_channels: int  # video latents (1, C, f, h, w)
    audio_latent_channels: int  # audio latent rows (rows, C_audio)


def check_shape(name: str, shape: tuple[int, ...], expected: tuple[int | None, ...]) -> None:
    """`expected` holds the size of each dimension, None where any positive size will do."""
    if len(shape) != len(expected) or any(
        s < 1 or (e is not None and s != e) for s, e in zip(shape, expected, strict=True)
    ):
        wanted = ", ".join("*" if e is None else str(e) for e in expected)
        raise InvalidRequest(name, f"shape {list(shape)}, expected [{wanted}]")


class TextCounter(Protocol):
    """Counts text-encoder output rows with the deployment's tokenizer and processor (the gateway's admission)."""

    def tokens(self, text: str) -> int: ...

    def picture(self, index: int, height: int, width: int) -> int: ...

    def video(self, index: int, frames: int, height: int, width: int) -> int: ...


@dataclass
class PreparedMedia:
    """One request's keyframes or references after diffusers' set-up block, inside a stage."""

    inputs: dict  # what the text-encoder and VAE-encode blocks read
    items: list  # one entry per asset, packed order (VAE encodes them one by one)
    manifest: dict = field(default_factory=dict)  # DenoiseSpec fields the DiT needs: keyframe_anchors / references


class Workflow:
    name: str  # "t2va"
    value: common_pb2.Workflow
    partition: str = "transformer"  # the transformer checkpoint partition the DiT runs it on
    media_fields: tuple[str, ...] = ()  # GenerateRequest fields that carry its media
    plan: Plan = T2VA_PLAN

    # Gateway side.

    def resolve_media(
        self,
        request: gateway_pb2.GenerateRequest,
        resolved: gateway_pb2.ResolvedRequest,
        assets: AssetLookup,
        geometry: Geometry,
    ) -> None:
        """Check the media against the stored assets and the model's rules, copy them into `resolved` and set the
        canvas when the media decide it; raise InvalidRequest naming the field."""

    def label_counts(self, resolved: gateway_pb2.ResolvedRequest) -> dict[str, int]:
        """How many keyframes / references of each label kind ("Picture", "Video", "Audio") the prompt may name."""
        return {}

    def condition_rows(self, resolved: gateway_pb2.ResolvedRequest, assets: AssetLookup, geometry: Geometry) -> Rows:
        """The packed DiT rows of the keyframes / references."""
        return Rows()

    def text_rows(
        self, resolved: gateway_pb2.ResolvedRequest, assets: AssetLookup, text: TextCounter, geometry: Geometry
    ) -> int:
        """Rows of the text encoder's output: labels and vision tokens of the media, then the prompt."""
        return text.tokens(resolved.prompt)

    def media_items(self, resolved: gateway_pb2.ResolvedRequest, assets: AssetLookup) -> list[media_pb2.MediaItem]:
        """The assets the encoder and VAE stages receive, in packed order."""
        return []

    def check_items(self, items: list[media_pb2.MediaItem]) -> None:
        """What a stage checks of a media request's assets (MediaSpec.items) before it reads them: kinds, roles and
        counts; MediaError naming `items`."""
        raise MediaError(f"items: {self.name} takes no media")

    # Stage side (diffusers is imported inside).

    def setup_block(self):
        """diffusers' model-free set-up block that normalises the media (None: no media)."""
        return None

    def prepare_media(
        self, pipe, spec: media_pb2.MediaSpec, items: list[media_pb2.MediaItem], decoded: list
    ) -> PreparedMedia:
        """Run the set-up `pipe` over the decoded assets (diffusers' reference dataclasses, `items` order)."""
        raise NotImplementedError(f"{self.name} takes no media")

    def text_encoder_block(self):
        raise NotImplementedError

    def vae_encoder_block(self):
        """diffusers' block that encodes the media into conditioning latents (None: no media)."""
        return None

    def encode_condition(self, pipe, item) -> tuple[list, list]:
        """One prepared asset through the VAE-encode `pipe`: (video condition latents, audio condition latents)."""
        raise NotImplementedError(f"{self.name} takes no media")

    def core_denoise_step(self):
        """diffusers' core denoise step of the workflow (the DiT replaces its loop with an observed one)."""
        raise NotImplementedError

    def tensor_names(self, spec: dit_pb2.DenoiseSpec) -> tuple[str, ...]:
        """Every tensor a Denoise request of `spec` carries."""
        return ("prompt_embeds", "text_token_tags")

    def check_manifest(self, spec: dit_pb2.DenoiseSpec) -> None:
        """The spec's keyframe_anchors / references, before the DiT reads a tensor; ValueError naming the field."""
        if spec.keyframe_anchors or spec.references:
            raise ValueError(f"keyframe_anchors / references: {self.name} takes none")

    def check_conditioning(
        self, spec: dit_pb2.DenoiseSpec, shapes: dict[str, tuple[int, ...]], dims: ModelDims, geometry: Geometry
    ) -> None:
        """The shapes of the conditioning tensors (`tensor_names` past the text ones) against the spec's manifest,
        its canvas and frames, and the model; InvalidRequest naming the tensor."""

    def denoise_inputs(self, spec: dit_pb2.DenoiseSpec, tensors: dict) -> dict:
        """The core denoise step's workflow inputs from the spec's manifest and the conditioning tensors;
        ValueError for a manifest this workflow does not take."""
        self.check_manifest(spec)
        return {}

    def pipeline_inputs(self, media: dict[str, list]) -> dict:
        """The in-process MiniMaxH3Blocks inputs of decoded media, given per GenerateRequest field."""
        return {}


def numbered(tensors: dict, prefix: str) -> list:
    """Tensors named `<prefix>.0`, `<prefix>.1`, ... in number order."""
    names = sorted((n for n in tensors if n.startswith(prefix + ".")), key=lambda n: int(n.rsplit(".", 1)[1]))
    return [tensors[n] for n in names]
