"""Small media files made in the tests themselves (Pillow, PyAV, numpy): no binary fixtures."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
from PIL import Image


def image(path: Path, width: int, height: int, seed: int = 0, fmt: str = "PNG") -> Path:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, fmt)
    return path


def _audio_frame(samples: np.ndarray, rate: int, fmt: str, layout: str) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(samples, format=fmt, layout=layout)
    frame.sample_rate = rate
    return frame


def _mux_all(container, stream, frames) -> None:
    """Encode `frames`, flush the encoder, mux every packet."""
    for frame in [*frames, None]:
        for packet in stream.encode(frame):
            container.mux(packet)


def wav(path: Path, seconds: float, rate: int = 32000, seed: int = 0) -> Path:
    """Mono 16-bit PCM noise."""
    samples = (np.random.default_rng(seed).standard_normal((1, int(seconds * rate))) * 3000).astype(np.int16)
    with av.open(str(path), "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate, layout="mono")
        _mux_all(container, stream, [_audio_frame(samples, rate, "s16", "mono")])
    return path


def mp4(path: Path, width: int, height: int, frames: int, fps: int = 24, seed: int = 0,
        audio_rate: int | None = 32000) -> Path:
    """H.264 noise frames, with an AAC stereo soundtrack as long as the video unless audio_rate is None."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=audio_rate, layout="stereo") if audio_rate else None
        _mux_all(container, video, [av.VideoFrame.from_ndarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8),
                                                               format="rgb24") for _ in range(frames)])
        if audio:
            samples = (rng.standard_normal((2, int(frames / fps * audio_rate))) * 0.1).astype(np.float32)
            _mux_all(container, audio, [_audio_frame(samples, audio_rate, "fltp", "stereo")])
    path.write_bytes(buffer.getvalue())
    return path
