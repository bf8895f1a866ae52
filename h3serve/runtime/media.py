"""Keyframes and references inside a stage: compressed asset bytes in, diffusers' normalised media out.

The gateway streams each asset's original bytes; the encoder and the VAE both decode them here and
run diffusers' own model-free set-up blocks (`MiniMaxH3ResizeStep` for fl2va,
`MiniMaxH3Ref2VASetupStep` for ref2va) with the deployment's geometry, so both stages see exactly the
media the in-process pipeline sees, and decoded frames never cross the network.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from h3serve.v1 import common_pb2, media_pb2
from h3serve.common.config import ModelGeometry

MODEL_SAMPLE_RATE = 32000  # the audio VAE's rate


class MediaError(ValueError):
    """A media stream or asset a stage cannot turn into the model's inputs."""


@dataclass(frozen=True)
class MediaAsset:
    item: media_pb2.MediaItem
    data: bytes


@dataclass
class PreparedMedia:
    """The normalised conditioning of one request, as diffusers' blocks take it."""

    workflow: int
    keyframes: list = field(default_factory=list)          # fl2va: PIL images on the canvas, packed order
    keyframe_anchors: tuple[str, ...] = ()                  # fl2va: "first" / "last"
    normalized_references: list = field(default_factory=list)  # ref2va: diffusers reference dataclasses

    def block_inputs(self) -> dict:
        """The inputs the workflow's text-encoder and VAE-encoder blocks read."""
        if self.workflow == common_pb2.WORKFLOW_FL2VA:
            return {"keyframes": self.keyframes}
        return {"normalized_references": self.normalized_references}

    def items(self) -> list:
        """One entry per asset, in packed order (what progress counts)."""
        return self.keyframes if self.workflow == common_pb2.WORKFLOW_FL2VA else self.normalized_references


def read_media_stream(messages: Iterable[media_pb2.MediaInput]) -> tuple[media_pb2.MediaSpec, list[MediaAsset]]:
    """One spec, then every item's bytes as contiguous chunks in `items` order."""
    spec, buffers, current = None, [], 0
    for message in messages:
        kind = message.WhichOneof("kind")
        if kind == "spec" and spec is None:
            spec = message.spec
            if spec.workflow not in (common_pb2.WORKFLOW_FL2VA, common_pb2.WORKFLOW_REF2VA):
                raise MediaError(f"workflow: {common_pb2.Workflow.Name(spec.workflow)} carries no media")
            if not spec.items:
                raise MediaError("items: a media request needs at least one asset")
            buffers = [bytearray() for _ in spec.items]
        elif kind == "chunk" and spec is not None:
            chunk = message.chunk
            while current < len(spec.items) and len(buffers[current]) == spec.items[current].bytes:
                current += 1
            if current == len(spec.items) or chunk.asset_id != spec.items[current].asset_id:
                raise MediaError(f"chunk of asset {chunk.asset_id!r} out of order: send the items' bytes in order")
            if chunk.offset != len(buffers[current]):
                raise MediaError(f"asset {chunk.asset_id!r}: chunk at offset {chunk.offset}, "
                                 f"expected {len(buffers[current])}")
            buffers[current].extend(chunk.data)
            if len(buffers[current]) > spec.items[current].bytes:
                raise MediaError(f"asset {chunk.asset_id!r}: more than the {spec.items[current].bytes} bytes announced")
        else:
            raise MediaError(f"unexpected {kind or 'empty'} message: send one spec, then the assets' chunks")
    if spec is None:
        raise MediaError("stream ended without a spec")
    for item, data in zip(spec.items, buffers):
        if len(data) != item.bytes:
            raise MediaError(f"asset {item.asset_id!r} truncated: {len(data)} of {item.bytes} bytes arrived")
    return spec, [MediaAsset(item, bytes(data)) for item, data in zip(spec.items, buffers)]


def media_inputs(spec: media_pb2.MediaSpec, chunks: Callable[[str], Iterable[bytes]]) -> Iterator[media_pb2.MediaInput]:
    """The request stream for `spec`: the spec, then each item's bytes as `chunks(asset_id)` yields them."""
    yield media_pb2.MediaInput(spec=spec)
    for item in spec.items:
        offset = 0
        for data in chunks(item.asset_id):
            yield media_pb2.MediaInput(chunk=media_pb2.MediaChunk(asset_id=item.asset_id, offset=offset, data=data))
            offset += len(data)


def _to_model_rate(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Resample a (channels, samples) float waveform to 32 kHz with PyAV (torchaudio, which diffusers would use
    for this, is not installed); waveforms already at 32 kHz are never touched."""
    import av

    layout = "mono" if audio.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio.numpy(), dtype=np.float32), format="fltp",
                                       layout=layout)
    frame.sample_rate = sample_rate
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=MODEL_SAMPLE_RATE)
    out = [f.to_ndarray() for f in (*resampler.resample(frame), *resampler.resample(None))]
    return torch.from_numpy(np.concatenate(out, axis=-1)).to(torch.float32)


def decode_reference(kind: int, path: str):
    """diffusers' own reference dataclass for a local file, at the rates the file carries."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    if kind == media_pb2.ASSET_KIND_IMAGE:
        return MiniMaxH3ImageReference.from_file(path)
    reference = (MiniMaxH3VideoReference if kind == media_pb2.ASSET_KIND_VIDEO else MiniMaxH3AudioReference) \
        .from_file(path)
    if reference.audio is not None and reference.sample_rate != MODEL_SAMPLE_RATE:
        reference.audio, reference.sample_rate = _to_model_rate(reference.audio, reference.sample_rate), \
            MODEL_SAMPLE_RATE
    return reference


def decode_asset(asset: MediaAsset):
    """Decode one asset's bytes (through a private temporary file: diffusers' decoders take paths)."""
    fd, path = tempfile.mkstemp(prefix="h3-asset-")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(asset.data)
        return decode_reference(asset.item.kind, path)
    except MediaError:
        raise
    except Exception as exc:  # PyAV / Pillow errors: the asset, not the service, is at fault
        raise MediaError(f"asset {asset.item.asset_id}: cannot decode: {exc}") from exc
    finally:
        os.remove(path)


class MediaPreparer:
    """diffusers' set-up blocks for fl2va and ref2va, configured with the deployment's geometry."""

    def __init__(self, geometry: ModelGeometry) -> None:
        from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep, MiniMaxH3ResizeStep

        # Without the VAEs the blocks use MiniMax-H3's own canvas multiple (32) and sample rate (32 kHz).
        self.pipes = {}
        for workflow, block in ((common_pb2.WORKFLOW_FL2VA, MiniMaxH3ResizeStep()),
                                (common_pb2.WORKFLOW_REF2VA, MiniMaxH3Ref2VASetupStep())):
            pipe = block.init_pipeline()
            pipe.update_components(**{name: value for name, value in geometry.pipeline_configs().items()
                                      if name in pipe.config})
            self.pipes[workflow] = pipe

    def prepare(self, spec: media_pb2.MediaSpec, assets: list[MediaAsset]) -> PreparedMedia:
        references = [decode_asset(asset) for asset in assets]
        try:
            if spec.workflow == common_pb2.WORKFLOW_FL2VA:
                return self._keyframes(spec, assets, references)
            out = self.pipes[spec.workflow](references=references, height=spec.height, width=spec.width,
                                            num_frames=spec.num_frames, output=["normalized_references"])
        except ValueError as exc:  # the model's own checks of the media
            raise MediaError(str(exc).strip().splitlines()[-1]) from exc
        return PreparedMedia(spec.workflow, normalized_references=out["normalized_references"])

    def _keyframes(self, spec, assets: list[MediaAsset], references: list) -> PreparedMedia:
        by_role = {asset.item.role: reference.image for asset, reference in zip(assets, references)}
        if len(by_role) != len(assets) or \
                set(by_role) - {media_pb2.MEDIA_ROLE_FIRST_FRAME, media_pb2.MEDIA_ROLE_LAST_FRAME} or \
                any(asset.item.kind != media_pb2.ASSET_KIND_IMAGE for asset in assets):
            raise MediaError("items: fl2va takes one first and/or one last keyframe, both images")
        out = self.pipes[spec.workflow](
            image=by_role.get(media_pb2.MEDIA_ROLE_FIRST_FRAME), last_image=by_role.get(media_pb2.MEDIA_ROLE_LAST_FRAME),
            height=spec.height, width=spec.width, output=["keyframes", "keyframe_anchors"])
        return PreparedMedia(spec.workflow, keyframes=out["keyframes"], keyframe_anchors=tuple(out["keyframe_anchors"]))
