"""Asset validation: what an uploaded file is, decided by its content, and whether it is within the limits.

The format comes from the file's magic bytes, never its name; a full decode (Pillow for images, PyAV
for video and audio) then proves the content is what it claims and measures it. Every refusal is an
`AssetRefused` that names the asset and the limit or the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from h3serve.common.bounds import clip, shown, without_path
from h3serve.common.config import GatewayConfig
from h3serve.v1 import gateway_pb2, media_pb2

IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO
KIND_NAMES: dict[int, str] = {IMAGE: "image", VIDEO: "video", AUDIO: "audio"}
SNIFF_BYTES = 16

# Container formats whose kind is decided by the streams inside (a video stream makes it a video).
_CONTAINER_KINDS = {"mp4": (VIDEO, AUDIO), "mov": (VIDEO,), "webm": (VIDEO, AUDIO), "ogg": (AUDIO,), "m4a": (AUDIO,)}
_IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # our name -> Pillow's
_AUDIO_FORMATS = ("wav", "flac", "mp3", "aac")


class AssetRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message
        super().__init__(message)


def invalid(name: str, reason: str) -> AssetRefused:
    return AssetRefused(grpc.StatusCode.INVALID_ARGUMENT, f"asset {shown(name)}: {reason}")


def over_limit(name: str, what: str, value, limit, setting: str) -> AssetRefused:
    """INVALID_ARGUMENT like every over-limit refusal: the same file is refused again (RESOURCE_EXHAUSTED is only
    the retryable full queue)."""
    return AssetRefused(
        grpc.StatusCode.INVALID_ARGUMENT, f"asset {shown(name)}: {what} {value}, over the limit of {limit} ({setting})"
    )


def undecodable(path: str, name: str, what: str, exc: Exception) -> AssetRefused:
    """Pillow and PyAV name the file they could not read: the spooled upload's path, which is the server's own."""
    return invalid(name, f"not a decodable {what}: {clip(without_path(str(exc), path, clip(name)))}")


@dataclass(frozen=True)
class AssetLimits:
    max_image_bytes: int = 20 << 20
    max_video_bytes: int = 100 << 20
    max_audio_bytes: int = 30 << 20
    max_image_pixels: int = 8192 * 8192
    max_video_pixels: int = 3840 * 2160
    max_video_seconds: float = 60.0
    max_audio_seconds: float = 60.0

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> AssetLimits:
        return cls(
            cfg.max_image_bytes,
            cfg.max_video_bytes,
            cfg.max_audio_bytes,
            cfg.max_image_pixels,
            cfg.max_video_pixels,
            cfg.max_video_seconds,
            cfg.max_audio_seconds,
        )

    def max_bytes(self, kinds) -> tuple[int, str]:
        """The byte limit for content that may be any of `kinds`, and its setting's name."""
        return max((getattr(self, f"max_{KIND_NAMES[k]}_bytes"), f"max_{KIND_NAMES[k]}_bytes") for k in kinds)


def sniff(head: bytes) -> str | None:
    """The format named by a file's first bytes, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:4] == b"RIFF" and head[8:12] in (b"WEBP", b"WAVE"):
        return "webp" if head[8:12] == b"WEBP" else "wav"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        return "mov" if brand == b"qt  " else "m4a" if brand in (b"M4A ", b"M4B ") else "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "webm"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"ID3"):
        return "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        return "aac" if head[1] & 0x06 == 0 else "mp3"  # MPEG sync word; layer bits 00 mark ADTS AAC
    return None


def candidate_kinds(fmt: str) -> tuple[int, ...]:
    if fmt in _IMAGE_FORMATS:
        return (IMAGE,)
    return _CONTAINER_KINDS.get(fmt, (AUDIO,))


def inspect(path: str, name: str, fmt: str, size: int, limits: AssetLimits) -> gateway_pb2.Asset:
    """Fully decode the file at `path` (sniffed as `fmt`) and describe it; AssetRefused if it is not valid."""
    asset = _inspect_image(path, name, fmt, limits) if fmt in _IMAGE_FORMATS else _inspect_av(path, name, fmt, limits)
    limit, setting = limits.max_bytes((asset.kind,))
    if size > limit:
        raise over_limit(name, "size", f"{size} bytes", f"{limit} bytes", setting)
    asset.format, asset.bytes = fmt, size
    return asset


def _inspect_image(path: str, name: str, fmt: str, limits: AssetLimits) -> gateway_pb2.Asset:
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.format != _IMAGE_FORMATS[fmt]:
                raise invalid(name, f"starts like {fmt} but Pillow reads it as {image.format}")
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise over_limit(
                    name,
                    "image of",
                    f"{width}x{height} = {width * height} pixels",
                    limits.max_image_pixels,
                    "max_image_pixels",
                )
            image.load()  # the full decode: a truncated or corrupt file fails here
    except AssetRefused:
        raise
    except Exception as exc:
        raise undecodable(path, name, f"{fmt} image", exc) from exc
    return gateway_pb2.Asset(kind=IMAGE, width=width, height=height)


def _inspect_av(path: str, name: str, fmt: str, limits: AssetLimits) -> gateway_pb2.Asset:
    import av

    try:
        with av.open(path) as container:
            kinds = candidate_kinds(fmt)
            if container.streams.video and VIDEO in kinds:
                asset = _measure_video(container, name, limits)
            elif container.streams.audio and AUDIO in kinds:
                asset = gateway_pb2.Asset(kind=AUDIO)
            else:
                raise invalid(name, f"{fmt} file without a {' or '.join(KIND_NAMES[k] for k in kinds)} stream")
            if container.streams.audio:
                container.seek(0)
                seconds_limit = limits.max_video_seconds if asset.kind == VIDEO else limits.max_audio_seconds
                _measure_audio(
                    container,
                    asset,
                    name,
                    seconds_limit,
                    "max_video_seconds" if asset.kind == VIDEO else "max_audio_seconds",
                )
    except AssetRefused:
        raise
    except Exception as exc:
        raise undecodable(path, name, f"{fmt} file", exc) from exc
    return asset


def _measure_video(container, name: str, limits: AssetLimits) -> gateway_pb2.Asset:
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > limits.max_video_pixels:
        raise over_limit(
            name,
            "video of",
            f"{width}x{height} = {width * height} pixels per frame",
            limits.max_video_pixels,
            "max_video_pixels",
        )
    fps = float(stream.average_rate or stream.guessed_rate or 0)
    if fps <= 0:
        raise invalid(name, "video stream without a frame rate")
    frames = 0
    for _ in container.decode(stream):
        frames += 1
        if frames / fps > limits.max_video_seconds:
            raise over_limit(
                name,
                "video duration",
                f"past {limits.max_video_seconds:g} s",
                f"{limits.max_video_seconds:g} s",
                "max_video_seconds",
            )
    if not frames:
        raise invalid(name, "video stream without decodable frames")
    return gateway_pb2.Asset(
        kind=VIDEO, width=width, height=height, num_frames=frames, fps=fps, duration_s=frames / fps
    )


def _measure_audio(container, asset: gateway_pb2.Asset, name: str, max_seconds: float, setting: str) -> None:
    stream = container.streams.audio[0]
    rate = int(stream.codec_context.sample_rate)
    samples = 0
    for frame in container.decode(stream):
        samples += frame.samples
        if samples / rate > max_seconds:
            raise over_limit(name, "audio duration", f"past {max_seconds:g} s", f"{max_seconds:g} s", setting)
    if not samples:
        raise invalid(name, "audio stream without decodable samples")
    asset.has_audio, asset.sample_rate, asset.audio_samples = True, rate, samples
    if asset.kind == AUDIO:
        asset.duration_s = samples / rate
