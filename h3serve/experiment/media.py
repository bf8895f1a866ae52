"""Keyframes and references for fl2va / ref2va jobs: the load file's files, or small ones made here (a noise PNG of
the job's canvas, a 2 s noise WAV), uploaded once each; a job names them by asset id."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.client import GatewayClient

# A canvas-less mix entry (the deployment's default canvas) gets a keyframe of this size; the gateway fits the
# canvas to its aspect.
DEFAULT_IMAGE = (64, 32)  # width, height
WAV_SECONDS, WAV_RATE = 2.0, 32000


def make_png(path: Path, width: int, height: int, seed: int) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "PNG")
    return path


def make_wav(path: Path, seed: int) -> Path:
    samples = np.random.default_rng(seed).standard_normal(int(WAV_SECONDS * WAV_RATE)) * 3000
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(WAV_RATE)
        out.writeframes(samples.astype("<i2").tobytes())
    return path


class Uploads:
    """Uploads each file once (the gateway stores content once anyway; this saves the transfer)."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self.ids: dict[str, str] = {}

    def __call__(self, path: str | Path) -> str:
        key = str(Path(path).resolve())
        if key not in self.ids:
            self.ids[key] = self.client.upload(key).asset_id
        return self.ids[key]


def made_media(workflow: str, width: int, height: int, folder: Path, seed: int) -> dict[str, list[Path]]:
    """The media a mix entry without files gets: {request field: files}."""
    folder.mkdir(parents=True, exist_ok=True)
    width, height = (width, height) if width else DEFAULT_IMAGE
    image = make_png(folder / f"image-{width}x{height}-{seed}.png", width, height, seed)
    if workflow == "fl2va":
        return {"first_frame": [image]}
    if workflow == "ref2va":
        return {"references": [image, make_wav(folder / f"audio-{seed}.wav", seed)]}
    return {}
