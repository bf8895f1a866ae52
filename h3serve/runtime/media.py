"""Keyframes and references inside a stage: compressed asset bytes in, diffusers' normalised media out.

The gateway streams each asset's original bytes; the encoder and the VAE both decode them here and
run diffusers' own model-free set-up blocks (`MiniMaxH3ResizeStep` for fl2va,
`MiniMaxH3Ref2VASetupStep` for ref2va) with the deployment's geometry, so both stages see exactly the
media the in-process pipeline sees, and decoded frames never cross the network.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from h3serve.common.bounds import clip, without_path
from h3serve.model import rules, workflows
from h3serve.model.rules import Geometry
from h3serve.model.workflows.base import MediaError, PreparedMedia
from h3serve.v1 import media_pb2


@dataclass(frozen=True)
class MediaAsset:
    item: media_pb2.MediaItem
    data: bytes


def read_media_stream(messages: Iterable[media_pb2.MediaInput]) -> tuple[media_pb2.MediaSpec, list[MediaAsset]]:
    """One spec, then every item's bytes as contiguous chunks in `items` order."""
    spec, buffers, current = None, [], 0
    for message in messages:
        kind = message.WhichOneof("kind")
        if kind == "spec" and spec is None:
            spec = message.spec
            try:
                workflow = workflows.by_value(spec.workflow)
            except ValueError as exc:
                raise MediaError(str(exc)) from exc
            if not workflow.media_fields:
                raise MediaError(f"workflow: {workflow.name} carries no media")
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
                raise MediaError(
                    f"asset {chunk.asset_id!r}: chunk at offset {chunk.offset}, expected {len(buffers[current])}"
                )
            buffers[current].extend(chunk.data)
            if len(buffers[current]) > spec.items[current].bytes:
                raise MediaError(f"asset {chunk.asset_id!r}: more than the {spec.items[current].bytes} bytes announced")
        else:
            raise MediaError(f"unexpected {kind or 'empty'} message: send one spec, then the assets' chunks")
    if spec is None:
        raise MediaError("stream ended without a spec")
    for item, data in zip(spec.items, buffers, strict=True):
        if len(data) != item.bytes:
            raise MediaError(f"asset {item.asset_id!r} truncated: {len(data)} of {item.bytes} bytes arrived")
    return spec, [MediaAsset(item, bytes(data)) for item, data in zip(spec.items, buffers, strict=True)]


def _to_model_rate(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Resample a (channels, samples) float waveform to 32 kHz with PyAV (torchaudio, which diffusers would use
    for this, is not installed); waveforms already at 32 kHz are never touched."""
    import av

    layout = "mono" if audio.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(audio.numpy(), dtype=np.float32), format="fltp", layout=layout
    )
    frame.sample_rate = sample_rate
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=rules.SAMPLE_RATE)
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
    reference = (MiniMaxH3VideoReference if kind == media_pb2.ASSET_KIND_VIDEO else MiniMaxH3AudioReference).from_file(
        path
    )
    # from_file gives audio with its rate (diffusers reads a rate left out as the audio VAE's own)
    if reference.audio is not None and reference.sample_rate not in (None, rules.SAMPLE_RATE):
        reference.audio, reference.sample_rate = (
            _to_model_rate(reference.audio, reference.sample_rate),
            rules.SAMPLE_RATE,
        )
    return reference


KIND_NAMES = {
    media_pb2.ASSET_KIND_IMAGE: "an image",
    media_pb2.ASSET_KIND_VIDEO: "a video",
    media_pb2.ASSET_KIND_AUDIO: "audio",
}


def content_kind(data: bytes) -> tuple[int | None, str]:
    """What the bytes are, from their headers alone: (ASSET_KIND_*, "a PNG image" / "a video (mp4)" / "audio (wav)"),
    or (None, why) when neither Pillow nor PyAV recognises them (the decode then says what is wrong with them).

    Pillow first: PyAV also opens a still image (as a one-frame "video"), which is how a PNG declared as a video
    reached the VAE-encode block and ended as INTERNAL."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return media_pb2.ASSET_KIND_IMAGE, f"a {image.format or 'still'} image"
    except Exception:
        pass
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            names = (container.format.name or "unknown").split(",")
            fmt = "mp4" if "mp4" in names else names[0]
            if fmt.endswith("_pipe") or fmt == "image2":  # a still image Pillow could not open (a broken one)
                return media_pb2.ASSET_KIND_IMAGE, f"a {fmt.removesuffix('_pipe').upper()} image"
            if container.streams.video:
                return media_pb2.ASSET_KIND_VIDEO, f"a video ({fmt})"
            if container.streams.audio:
                return media_pb2.ASSET_KIND_AUDIO, f"audio ({fmt})"
            return None, f"a {fmt} file with neither video nor audio"
    except Exception:
        return None, "not a recognised image, video or audio file"


def check_kind(asset: MediaAsset) -> None:
    """MediaError naming the item when its bytes are plainly another kind of media than it declares (bytes nothing
    recognises are left to the decode, which names its own problem)."""
    actual, what = content_kind(asset.data)
    if actual is not None and actual != asset.item.kind:
        declared = KIND_NAMES.get(asset.item.kind, f"kind {asset.item.kind}")
        raise MediaError(f"asset {clip(asset.item.asset_id)}: declared {declared}, but its bytes are {what}")


def decode_asset(asset: MediaAsset):
    """Decode one asset's bytes (through a private temporary file: diffusers' decoders take paths)."""
    check_kind(asset)
    fd, path = tempfile.mkstemp(prefix="h3-asset-")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(asset.data)
        return decode_reference(asset.item.kind, path)
    except MediaError:
        raise
    except Exception as exc:  # PyAV / Pillow errors: the asset, not the service, is at fault
        reason = clip(without_path(str(exc), path, asset.item.asset_id))  # they name the file: ours is private
        raise MediaError(f"asset {asset.item.asset_id}: cannot decode: {reason}") from exc
    finally:
        os.remove(path)


class MediaPreparer:
    """diffusers' set-up blocks of the workflows with media, configured with the deployment's geometry."""

    def __init__(self, geometry: Geometry) -> None:
        # Without the VAEs the blocks use MiniMax-H3's own canvas multiple (32) and sample rate (32 kHz).
        self.pipes = {}
        for workflow in workflows.WORKFLOWS:
            if workflow.media_fields:
                pipe = workflow.setup_block().init_pipeline()
                pipe.update_components(
                    **{name: value for name, value in geometry.pipeline_configs().items() if name in pipe.config}
                )
                self.pipes[workflow.value] = pipe

    def prepare(self, spec: media_pb2.MediaSpec, assets: list[MediaAsset]) -> PreparedMedia:
        decoded = [decode_asset(asset) for asset in assets]
        try:
            prepared = workflows.by_value(spec.workflow).prepare_media(
                self.pipes[spec.workflow], spec, [asset.item for asset in assets], decoded
            )
        except MediaError:
            raise
        except ValueError as exc:  # the model's own checks of the media
            raise MediaError(str(exc).strip().splitlines()[-1]) from exc
        _check_lengths(assets, prepared)
        return prepared


def _check_lengths(assets: list[MediaAsset], prepared: PreparedMedia) -> None:
    """A video reference too short for the blocks after the set-up (the text encoder's 2 fps sampling, the video
    VAE's first chunk), refused by name as admission refuses its asset; they would raise a bare ValueError."""
    for asset, item in zip(assets, prepared.items, strict=False):
        if getattr(item, "kind", None) == "video" and item.frames.shape[0] < rules.MIN_REFERENCE_FRAMES:
            raise MediaError(
                f"asset {clip(asset.item.asset_id)}: a video reference needs at least "
                f"{rules.MIN_REFERENCE_FRAMES} frames at {rules.FPS} fps (17n+5, n >= 1), got "
                f"{item.frames.shape[0]}"
            )
