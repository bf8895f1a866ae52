"""MP4 muxing in memory: H.264 video + AAC stereo audio, one second at a time."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from fractions import Fraction

import av
import numpy as np
import torch

FPS = 24

Progress = Callable[[int, int], None]
"""Called with (seconds of video encoded, seconds in the video)."""


def to_uint8(frames: np.ndarray | torch.Tensor) -> np.ndarray:
    """[0, 1] float frames (..., H, W, 3) -> contiguous uint8 numpy on the CPU: x * 255 rounded to the
    nearest level (ties to even), clipped to [0, 255].

    A tensor is converted where it is, so a decode on the GPU sends a quarter of the float bytes; numpy
    frames (the in-process pipeline's) stay in numpy.
    """
    xp = torch if isinstance(frames, torch.Tensor) else np  # the same arithmetic in either library
    levels = frames * 255
    xp.round(levels, out=levels)  # in place: no second frames-sized buffer
    xp.clip(levels, 0, 255, out=levels)
    if xp is np:
        return levels.astype(np.uint8)
    return levels.to(torch.uint8, memory_format=torch.contiguous_format).cpu().numpy()


def encode_mp4(frames: np.ndarray, audio: np.ndarray, sample_rate: int, on_progress: Progress) -> bytes:
    """Encode `frames` (F, H, W, 3) at `FPS` and `audio` (channels, S) float to MP4 bytes.

    `frames` are uint8 levels, or floats in [0, 1] that `to_uint8` turns into levels a second at a time.

    Video and audio are written interleaved per second of video, which is also the progress unit;
    audio past the last whole second goes with the last one.
    """
    seconds = math.ceil(len(frames) / FPS)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        video = _add_video(container, width=frames.shape[2], height=frames.shape[1])
        sound = _add_audio(container, sample_rate, channels=audio.shape[0])
        for second in range(seconds):
            last = second == seconds - 1
            _write_video(container, video, frames[second * FPS:(second + 1) * FPS], first=second * FPS)
            samples = slice(second * sample_rate, None if last else (second + 1) * sample_rate)
            _write_audio(container, sound, audio[:, samples], first=second * sample_rate)
            on_progress(second + 1, seconds)
        for stream in (video, sound):
            container.mux(stream.encode(None))  # flush the encoders' delayed packets
    return buffer.getvalue()


def _add_video(container, width: int, height: int):
    stream = container.add_stream("libx264", rate=FPS)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    return stream


def _add_audio(container, sample_rate: int, channels: int):
    layout = {1: "mono", 2: "stereo"}[channels]
    return container.add_stream("aac", rate=sample_rate, layout=layout)


def _write_video(container, stream, frames: np.ndarray, first: int) -> None:
    for index, pixels in enumerate(frames if frames.dtype == np.uint8 else to_uint8(frames), start=first):
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
        frame.pts, frame.time_base = index, Fraction(1, FPS)
        container.mux(stream.encode(frame))


def _write_audio(container, stream, samples: np.ndarray, first: int) -> None:
    if not samples.shape[1]:
        return
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32), format="fltp",
                                       layout=stream.layout.name)
    frame.sample_rate, frame.pts, frame.time_base = stream.rate, first, Fraction(1, stream.rate)
    container.mux(stream.encode(frame))
