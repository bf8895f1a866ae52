"""Small media files made where they are used (Pillow, PyAV, numpy): no binary fixtures. The tests and the benches
make their request media here."""

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


def _converted(resampler: av.AudioResampler, frame: av.AudioFrame) -> list[av.AudioFrame]:
    return [*resampler.resample(frame), *resampler.resample(None)]


def _mux_all(container, stream, frames) -> None:
    """Encode `frames`, flush the encoder, mux every packet."""
    for frame in [*frames, None]:
        for packet in stream.encode(frame):
            container.mux(packet)


def audio(
    path: Path, seconds: float, rate: int = 32000, seed: int = 0, container: str = "wav", codec: str = "pcm_s16le"
) -> Path:
    """Mono noise in any PyAV container/codec (the samples are converted to the codec's own format)."""
    samples = (np.random.default_rng(seed).standard_normal((1, int(seconds * rate))) * 0.1).astype(np.float32)
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate)
        _mux_all(out, stream, _converted(resampler, _audio_frame(samples, rate, "flt", "mono")))
    return path


def wav(path: Path, seconds: float, rate: int = 32000, seed: int = 0) -> Path:
    """Mono 16-bit PCM noise."""
    return audio(path, seconds, rate, seed)


def mp4(
    path: Path,
    width: int,
    height: int,
    frames: int,
    fps: int = 24,
    seed: int = 0,
    audio_rate: int | None = 32000,
    container: str = "mp4",
    codec: str = "libx264",
) -> Path:
    """Noise frames (H.264 in MP4 by default), with an AAC stereo soundtrack as long as the video unless
    audio_rate is None."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        video = out.add_stream(codec, rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = (
            out.add_stream("aac" if container != "webm" else "libopus", rate=audio_rate, layout="stereo")
            if audio_rate
            else None
        )
        _mux_all(
            out,
            video,
            [
                av.VideoFrame.from_ndarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8), format="rgb24")
                for _ in range(frames)
            ],
        )
        if sound:
            samples = (rng.standard_normal((2, int(frames / fps * audio_rate))) * 0.1).astype(np.float32)
            resampler = av.AudioResampler(format=sound.codec_context.format.name, layout="stereo", rate=audio_rate)
            _mux_all(out, sound, _converted(resampler, _audio_frame(samples, audio_rate, "fltp", "stereo")))
    path.write_bytes(buffer.getvalue())
    return path
