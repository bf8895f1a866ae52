"""The exact text rows a request puts in the DiT's packed sequence, known at submit without running a model.

The text encoder's output rows are the tokens of MiniMax-H3's presentation (diffusers' minimax_h3 text
encoder steps): per keyframe (fl2va) or reference (ref2va), in packed order, a label ("<Picture i>: ",
"<Audio j>: ", "<Video k>: ") tokenized on its own and, for pictures and videos, vision blocks of
<|vision_start|> + pads + <|vision_end|>; then the prompt, tokenized verbatim. The number of pads follows
from the media's size after the model's own resize (a keyframe on the canvas, an image reference at its
short edge, a video reference on its own canvas, read at 2 fps) and Qwen3-VL's processor rules
(`smart_resize` with the processor's patch, merge and pixel limits). Every vision row is a text row of
the DiT. Tokens are counted with the deployment's own tokenizer: a byte count is not a bound, since the
tokenizer's NFC normalisation can lengthen text (U+0958 is 3 bytes, 6 after NFC).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from h3serve.v1 import common_pb2, gateway_pb2
from h3serve.gateway.assets.validate import IMAGE, VIDEO
from h3serve.gateway.admission.media import image_reference_canvas, video_reference_frames
from h3serve.gateway.admission.request import FPS, canvas_for_aspect
from h3serve.common.config import ModelGeometry

VISION_MARKERS = 2          # <|vision_start|> and <|vision_end|> around every vision block
VIDEO_SAMPLE_FPS = 2.0      # the rate the text encoder reads a reference video at (diffusers' default)


@dataclass(frozen=True)
class VisionGeometry:
    """What Qwen3-VL's processors need to size a vision block: patch, merge, temporal patch, pixel limits."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def of(cls, processor) -> VisionGeometry:
        """From a loaded Qwen3VLProcessor (its image and video processors)."""
        image, video = processor.image_processor, processor.video_processor
        if not (image.do_resize and video.do_resize):
            raise ValueError("text rows: processors with do_resize = False are not supported")
        return cls(image.patch_size, image.merge_size, video.temporal_patch_size, image.size.shortest_edge,
                   image.size.longest_edge, video.size.shortest_edge, video.size.longest_edge,
                   bool(video.cap_pixels_per_frame), video.max_video_tokens)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def image_tokens(self, height: int, width: int) -> int:
        """Pads of one image block: Qwen2-VL's image smart_resize, then (h/patch)(w/patch)/merge^2."""
        h, w, f = height, width, self.factor
        h_bar, w_bar = round(h / f) * f, round(w / f) * f
        if h_bar * w_bar > self.image_max_pixels:
            beta = math.sqrt(h * w / self.image_max_pixels)
            h_bar, w_bar = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
        elif h_bar * w_bar < self.image_min_pixels:
            beta = math.sqrt(self.image_min_pixels / (h * w))
            h_bar, w_bar = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        return self._tokens(h_bar, w_bar)

    def video_block_tokens(self, frames: int, height: int, width: int) -> int:
        """Pads of one block of a video of `frames` sampled frames: Qwen3-VL's video smart_resize."""
        f, t = self.factor, self.temporal_patch_size
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * f * f, self.video_max_pixels // frames),
                            int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * frames
        if height < f or width < f:
            scale = max(f / height, f / width)
            height, width = int(height * scale), int(width * scale)
        h_bar, w_bar, t_bar = round(height / f) * f, round(width / f) * f, round(frames / t) * t
        if t_bar * h_bar * w_bar > max_pixels:
            beta = math.sqrt(frames * height * width / max_pixels)
            h_bar, w_bar = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif t_bar * h_bar * w_bar < self.video_min_pixels:
            beta = math.sqrt(self.video_min_pixels / (frames * height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return self._tokens(h_bar, w_bar)

    def _tokens(self, h_bar: int, w_bar: int) -> int:
        return (h_bar // self.patch_size) * (w_bar // self.patch_size) // self.merge_size ** 2


def sampled_frames(frames: int) -> int:
    """Frames the text encoder reads of a normalized 24 fps video: every 12th (2 fps), none twice."""
    stride, indices, cursor = FPS / VIDEO_SAMPLE_FPS, [], 0.0
    while round(cursor) < frames:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    return len(indices)


def video_block_timestamps(sampled: int, temporal_patch: int) -> list[float]:
    """The timestamp of every vision block: sampled frames merged in groups of `temporal_patch` (the last one
    repeated to fill a group), each block labelled with the mean of its first and last frame's time."""
    stamps = [index / VIDEO_SAMPLE_FPS for index in range(sampled)]
    stamps += [stamps[-1]] * (-len(stamps) % temporal_patch)
    return [(stamps[i] + stamps[i + temporal_patch - 1]) / 2 for i in range(0, len(stamps), temporal_patch)]


@dataclass(frozen=True)
class TextRows:
    """Counts a resolved request's text rows with the deployment's tokenizer and processor geometry."""

    count_tokens: Callable[[str], int]
    vision: VisionGeometry
    geometry: ModelGeometry = ModelGeometry()

    @classmethod
    def load(cls, model_dir: str, geometry: ModelGeometry) -> TextRows:
        """The tokenizer and processor the encoder loads from `model_dir` ("" = the tiny preset)."""
        from h3serve.runtime.models import ModelSource

        parts = ModelSource(model_dir or None).load(["tokenizer", "processor"], "cpu", "float32")
        tokenizer = parts["tokenizer"]
        return cls(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                   VisionGeometry.of(parts["processor"]), geometry)

    def __call__(self, request: gateway_pb2.ResolvedRequest, assets: Mapping[str, gateway_pb2.Asset]) -> int:
        rows = self.count_tokens(request.prompt)
        if request.workflow == common_pb2.WORKFLOW_FL2VA:
            keyframes = [k for k in (request.first_frame, request.last_frame) if k]
            for index in range(1, len(keyframes) + 1):
                rows += self._picture(index, request.height, request.width)
        counts = {"Picture": 0, "Video": 0, "Audio": 0}
        for reference in request.references:
            asset = assets[reference.asset_id]
            if asset.has_audio:
                counts["Audio"] += 1
                rows += self.count_tokens(f"<Audio {counts['Audio']}>: ")
            if asset.kind == IMAGE:
                counts["Picture"] += 1
                height, width = image_reference_canvas(asset.width, asset.height,
                                                       self.geometry.reference_image_short_edge)
                rows += self._picture(counts["Picture"], height, width)
            elif asset.kind == VIDEO:
                counts["Video"] += 1
                rows += self._video(counts["Video"], asset, request.num_frames)
        return rows

    def _picture(self, index: int, height: int, width: int) -> int:
        return self.count_tokens(f"<Picture {index}>: ") + VISION_MARKERS + self.vision.image_tokens(height, width)

    def _video(self, index: int, asset: gateway_pb2.Asset, num_frames: int) -> int:
        height, width = canvas_for_aspect(asset.width, asset.height, self.geometry.canvas_short_edge,
                                          self.geometry.canvas_max_pixels)
        sampled = sampled_frames(video_reference_frames(asset, num_frames))
        stamps = video_block_timestamps(sampled, self.vision.temporal_patch_size)
        per_block = VISION_MARKERS + self.vision.video_block_tokens(sampled, height, width)
        return self.count_tokens(f"<Video {index}>: ") + sum(
            self.count_tokens(f"<{stamp:.1f} seconds>") + per_block for stamp in stamps)
