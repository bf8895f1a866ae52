"""fl2va / ref2va requests at the gateway: keyframes and references resolved against the stored assets,
prompt labels checked, and every conditioning row they cost counted before anything runs.

The rules are MiniMax-H3's own (diffusers' resize and reference set-up blocks), restated without the
model: a keyframe sets the canvas by its aspect ratio; an image reference is upscaled to its own short
edge (2048 released) with no area cap; a video reference goes to 24 fps, onto the canvas of its own aspect
ratio, cut to the generated length and snapped down to 17n+5 frames; a soundtrack costs 40 latents per
second and channel. `conditioning_rows` is pure, so admission can use it with any capacity table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from h3serve.v1 import common_pb2, gateway_pb2
from h3serve.gateway.admission.capacity import packed_rows, rows_per_latent_frame
from h3serve.gateway.assets.validate import AUDIO, IMAGE, KIND_NAMES, VIDEO
from h3serve.gateway.admission.request import (
    CANVAS_MULTIPLE,
    FPS,
    FRAMES_PER_CHUNK,
    LATENTS_PER_CHUNK,
    MAX_ASPECT,
    InvalidRequest,
    canvas_for_aspect,
    latent_frames,
)
from h3serve.common.config import ModelGeometry

MAX_PER_KIND = {IMAGE: 9, VIDEO: 3, AUDIO: 3}
MAX_REFERENCES = 12
MIN_VIDEO_FRAMES = FRAMES_PER_CHUNK + LATENTS_PER_CHUNK  # 22 at 24 fps: the shortest clip the video VAE encodes
AUDIO_HOP = 800  # samples per audio latent at 32 kHz
MODEL_SAMPLE_RATE = 32000
_LABEL = re.compile(r"<(Picture|Video|Audio) (\d+)>")


@dataclass(frozen=True)
class Rows:
    condition_video: int = 0
    condition_audio: int = 0
    generated_video: int = 0
    generated_audio: int = 0

    @property
    def condition(self) -> int:
        return self.condition_video + self.condition_audio

    @property
    def total(self) -> int:
        return self.condition + self.generated_video + self.generated_audio


def image_reference_canvas(width: int, height: int, short_edge: int) -> tuple[int, int]:
    """(height, width) an image reference is resized to: its short edge to `short_edge`, rounded to 32."""
    scale = short_edge / min(width, height)
    return tuple(max(CANVAS_MULTIPLE, round(side * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)
                 for side in (height, width))


def video_reference_frames(asset: gateway_pb2.Asset, num_frames: int) -> int:
    """Frames of a video reference after the 24 fps resample and the cut to the generated length."""
    frames = asset.num_frames if asset.fps == FPS else math.floor(asset.num_frames * FPS / asset.fps + 0.5)
    return min(frames, num_frames)


def soundtrack_rows(asset: gateway_pb2.Asset, num_frames: int) -> int:
    """Rows of a soundtrack: both channels, one row per 800 samples at 32 kHz of its part within the video's length."""
    kept = min(asset.audio_samples, int(num_frames / FPS * asset.sample_rate))
    if asset.sample_rate != MODEL_SAMPLE_RATE:
        kept = round(kept * MODEL_SAMPLE_RATE / asset.sample_rate)
    return 2 * math.ceil(kept / AUDIO_HOP)


def conditioning_rows(request: gateway_pb2.ResolvedRequest, assets: Mapping[str, gateway_pb2.Asset],
                      geometry: ModelGeometry = ModelGeometry()) -> Rows:
    """Every packed DiT row of `request` besides its text: keyframes / references and the generated video + audio."""
    video = audio = 0
    if request.workflow == common_pb2.WORKFLOW_FL2VA:
        video = sum(bool(k) for k in (request.first_frame, request.last_frame)) * \
            rows_per_latent_frame(request.height, request.width)
    for reference in request.references:
        asset = assets[reference.asset_id]
        if asset.kind == IMAGE:
            video += rows_per_latent_frame(*image_reference_canvas(asset.width, asset.height,
                                                             geometry.reference_image_short_edge))
        elif asset.kind == VIDEO:
            frames = video_reference_frames(asset, request.num_frames)
            snapped = max(1, (frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK) * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK
            canvas = canvas_for_aspect(asset.width, asset.height, geometry.canvas_short_edge, geometry.canvas_max_pixels)
            video += latent_frames(snapped) * rows_per_latent_frame(*canvas)
        if asset.has_audio:
            audio += soundtrack_rows(asset, request.num_frames)
    generated = packed_rows(request.height, request.width, request.num_frames, text_rows=0)
    return Rows(video, audio, generated.video, generated.audio)


def _asset(lookup: Callable[[str], gateway_pb2.Asset | None], field: str, asset_id: str) -> gateway_pb2.Asset:
    asset = lookup(asset_id)
    if asset is None:
        raise InvalidRequest(field, f"no asset {asset_id!r}; upload the file with UploadAsset and pass its asset_id")
    return asset


def _aspect_ok(asset: gateway_pb2.Asset) -> bool:
    return asset.height <= MAX_ASPECT * asset.width and asset.width <= MAX_ASPECT * asset.height


def _keyframes(req, resolved, lookup, geometry: ModelGeometry) -> None:
    if req.references:
        raise InvalidRequest("references", "fl2va takes keyframes (first_frame, last_frame), not references")
    given = [(field, getattr(req, field)) for field in ("first_frame", "last_frame") if getattr(req, field)]
    if not given:
        raise InvalidRequest("first_frame", "fl2va needs a first_frame, a last_frame or both")
    for field, asset_id in given:
        asset = _asset(lookup, field, asset_id)
        if asset.kind != IMAGE:
            raise InvalidRequest(field, f"asset {asset_id!r} holds {KIND_NAMES[asset.kind]}; keyframes are images")
        if not _aspect_ok(asset):
            raise InvalidRequest(field, f"aspect ratio must be within 1:{MAX_ASPECT} and {MAX_ASPECT}:1, "
                                        f"got {asset.width}x{asset.height}")
        setattr(resolved, field, asset_id)
    if not req.height and not req.width:  # the canvas follows the (first given) keyframe
        anchor = lookup(given[0][1])
        resolved.height, resolved.width = canvas_for_aspect(anchor.width, anchor.height, geometry.canvas_short_edge,
                                                            geometry.canvas_max_pixels)


def _references(req, resolved, lookup) -> None:
    if req.first_frame or req.last_frame:
        field = "first_frame" if req.first_frame else "last_frame"
        raise InvalidRequest(field, "ref2va takes references, not keyframes")
    if not req.references:
        raise InvalidRequest("references", "ref2va needs at least one reference")
    counts = {IMAGE: 0, VIDEO: 0, AUDIO: 0}
    sounds = 0
    for index, given in enumerate(req.references):
        field = f"references[{index}]"
        asset = _asset(lookup, field, given.asset_id)
        if given.kind and given.kind != asset.kind:
            raise InvalidRequest(field, f"asset {given.asset_id!r} holds {KIND_NAMES[asset.kind]}, "
                                        f"not {KIND_NAMES.get(given.kind, given.kind)}")
        counts[asset.kind] += 1
        if counts[asset.kind] > MAX_PER_KIND[asset.kind]:
            raise InvalidRequest(field, f"a {_ordinal(counts[asset.kind])} {KIND_NAMES[asset.kind]} reference; "
                                        f"at most {MAX_PER_KIND[asset.kind]} {KIND_NAMES[asset.kind]} references")
        _check_reference(field, asset, resolved.num_frames)
        labels = []
        if asset.has_audio:
            sounds += 1
            labels.append(f"<Audio {sounds}>")
        if asset.kind != AUDIO:
            labels.append(f"<{'Picture' if asset.kind == IMAGE else 'Video'} {counts[asset.kind]}>")
        resolved.references.add(asset_id=asset.asset_id, kind=asset.kind, has_audio=asset.has_audio,
                                label=" ".join(labels))
    if len(req.references) > MAX_REFERENCES:
        raise InvalidRequest("references", f"{len(req.references)} references; at most {MAX_REFERENCES} in all")
    if counts[IMAGE] + counts[VIDEO] == 0:
        raise InvalidRequest("references", "audio references need at least one image or video reference with them")


def _check_reference(field: str, asset: gateway_pb2.Asset, num_frames: int) -> None:
    if asset.kind in (IMAGE, VIDEO) and not _aspect_ok(asset):
        raise InvalidRequest(field, f"aspect ratio must be within 1:{MAX_ASPECT} and {MAX_ASPECT}:1, "
                                    f"got {asset.width}x{asset.height}")
    if asset.kind == VIDEO and video_reference_frames(asset, num_frames) < MIN_VIDEO_FRAMES:
        raise InvalidRequest(field, f"a video reference needs at least {MIN_VIDEO_FRAMES} frames at {FPS} fps "
                                    f"(17n+5, n >= 1), got {video_reference_frames(asset, num_frames)}")


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _check_labels(prompt: str, resolved: gateway_pb2.ResolvedRequest) -> None:
    """Every <Picture i> / <Video k> / <Audio j> the prompt names must be a keyframe or reference of the request."""
    available = {"Picture": sum(bool(k) for k in (resolved.first_frame, resolved.last_frame)) +
                 sum(r.kind == IMAGE for r in resolved.references),
                 "Video": sum(r.kind == VIDEO for r in resolved.references),
                 "Audio": sum(r.has_audio for r in resolved.references)}
    for kind, number in _LABEL.findall(prompt):
        if not 1 <= int(number) <= available[kind]:
            raise InvalidRequest("prompt", f"names <{kind} {number}>, but the request has "
                                           f"{available[kind]} {kind.lower()}(s) to refer to "
                                           f"(numbered per kind from 1, in request order)")


def resolve_media(req: gateway_pb2.GenerateRequest, resolved: gateway_pb2.ResolvedRequest,
                  lookup: Callable[[str], gateway_pb2.Asset | None],
                  geometry: ModelGeometry) -> gateway_pb2.ResolvedRequest:
    """Complete `resolved` (from request.resolve) with keyframes / references, the canvas and the conditioning rows
    (admission counts them against the capacity: h3serve/gateway/admission/capacity.py)."""
    if resolved.workflow == common_pb2.WORKFLOW_FL2VA:
        _keyframes(req, resolved, lookup, geometry)
    elif resolved.workflow == common_pb2.WORKFLOW_REF2VA:
        _references(req, resolved, lookup)
    else:
        for field in ("first_frame", "last_frame", "references"):
            if getattr(req, field):
                raise InvalidRequest(field, "t2va takes no keyframes or references; set workflow FL2VA or REF2VA")
    if resolved.workflow != common_pb2.WORKFLOW_FL2VA and not req.height and not req.width:
        resolved.height, resolved.width = canvas_for_aspect(16, 9, geometry.canvas_short_edge,
                                                            geometry.canvas_max_pixels)
    _check_labels(resolved.prompt, resolved)
    resolved.condition_rows = conditioning_rows(resolved, referenced_assets(resolved, lookup), geometry).condition
    return resolved


def referenced_assets(resolved: gateway_pb2.ResolvedRequest,
                      lookup: Callable[[str], gateway_pb2.Asset | None]) -> dict[str, gateway_pb2.Asset]:
    """The stored assets a resolved ref2va request's references name, by id."""
    return {r.asset_id: lookup(r.asset_id) for r in resolved.references}
