"""MP4 muxing in memory: H.264 video encoded as the decode hands frames over, then AAC stereo audio."""

from __future__ import annotations

import io
import math
import queue
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import overload

import av
import numpy as np
import torch

FPS = 24
PRESET = "medium"  # libx264's own default; [vae] x264_preset (bench/mux.py measures the others)
THREADS = 0  # libx264's own thread count; [vae] x264_threads (1: reproducible bytes, config.py says why)

Progress = Callable[[int, int], None]
"""Called with (seconds of video encoded, seconds in the video)."""


def to_uint8(frames: np.ndarray | torch.Tensor) -> np.ndarray:
    """[0, 1] float frames (..., H, W, 3) -> contiguous uint8 numpy on the CPU: x * 255 rounded to the
    nearest level (ties to even), clipped to [0, 255].

    A tensor is converted where it is, so a decode on the GPU sends a quarter of the float bytes; numpy
    frames (the in-process pipeline's) stay in numpy.
    """
    levels = _levels(frames)
    return levels if isinstance(levels, np.ndarray) else levels.cpu().numpy()


def handed_over(frames: torch.Tensor) -> np.ndarray | LandingFrames:
    """`to_uint8` for a decode handing frames to the muxer: from a GPU, a copy queued behind the decode's own work
    instead of one it waits for (`LandingFrames`)."""
    levels = _levels(frames)
    return LandingFrames(levels) if levels.is_cuda else levels.numpy()


@overload
def _levels(frames: np.ndarray) -> np.ndarray: ...
@overload
def _levels(frames: torch.Tensor) -> torch.Tensor: ...
@overload
def _levels(frames: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor: ...
def _levels(frames: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    xp = torch if isinstance(frames, torch.Tensor) else np  # the same arithmetic in either library
    levels = frames * 255
    xp.round(levels, out=levels)  # in place: no second frames-sized buffer
    xp.clip(levels, 0, 255, out=levels)
    if isinstance(levels, np.ndarray):  # xp is np
        return levels.astype(np.uint8)
    return levels.to(torch.uint8, memory_format=torch.contiguous_format)


class LandingFrames:
    """uint8 frames on their way from a GPU to page-locked host memory. A decode that copied each chunk to the CPU
    waited for its GPU every chunk, and the GPU then waited for the decode to queue the next one; the muxer's
    worker waits for the copy instead (`numpy`)."""

    def __init__(self, levels: torch.Tensor) -> None:
        self._host = torch.empty(levels.shape, dtype=levels.dtype, pin_memory=True)
        self._host.copy_(levels, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()

    def __len__(self) -> int:
        return self._host.shape[0]

    def numpy(self) -> np.ndarray:
        self._landed.synchronize()
        return self._host.numpy()


class Muxer:
    """An MP4 written while its frames arrive: `add` hands frames to a worker thread that encodes them
    (libx264 runs its own threads too), `finish` adds the soundtrack and returns the file.

    Both streams are declared up front (a container's header lists them). The video is written as it
    comes and the audio after it; the container's interleaver orders the packets by time either way.
    Used as a context manager, so a decode that fails stops the worker and drops the partial file.
    """

    def __init__(
        self,
        frames: int,
        height: int,
        width: int,
        sample_rate: int,
        channels: int,
        on_progress: Progress,
        preset: str = PRESET,
        threads: int = THREADS,
    ) -> None:
        self._buffer = io.BytesIO()
        self._container = av.open(self._buffer, mode="w", format="mp4")
        self._video = _add_video(self._container, width=width, height=height, preset=preset, threads=threads)
        self._sound = _add_audio(self._container, sample_rate, channels)
        self._frames, self._written, self._on_progress = frames, 0, on_progress
        self._queue: queue.Queue[np.ndarray | LandingFrames | None] = queue.Queue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._encode_video, name="mux", daemon=True)
        self._worker.start()

    def add(self, frames: np.ndarray | LandingFrames) -> None:
        """Queue the next frames (f, H, W, 3): uint8 levels, floats in [0, 1] (`to_uint8`), or levels still landing
        from a GPU (`handed_over`)."""
        if self._error is not None:
            raise self._error
        self._queue.put(frames)

    def finish(self, audio: np.ndarray) -> bytes:
        """The MP4 bytes, once every queued frame is encoded and `audio` (channels, S) float is added."""
        self._stop()
        if self._error is not None:
            raise self._error
        if self._written != self._frames:
            raise ValueError(f"the muxer got {self._written} frames, expected {self._frames}")
        _write_audio(self._container, self._sound, audio, first=0)
        self._container.mux(self._sound.encode(None))
        self._container.close()
        return self._buffer.getvalue()

    def __enter__(self) -> Muxer:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self._container.close()  # idempotent; after a failure it leaves an unfinished file nobody reads

    def _stop(self) -> None:
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()

    def _seconds_done(self, frames: int) -> int:
        """Whole seconds of video in the first `frames`; the last second counts once it has all its frames."""
        return math.ceil(frames / FPS) if frames == self._frames else frames // FPS

    def _encode_video(self) -> None:
        seconds = math.ceil(self._frames / FPS)
        try:
            while (frames := self._queue.get()) is not None:
                first, self._written = self._written, self._written + len(frames)
                pixels = frames.numpy() if isinstance(frames, LandingFrames) else frames
                _write_video(self._container, self._video, pixels, first)
                for second in range(self._seconds_done(first) + 1, self._seconds_done(self._written) + 1):
                    self._on_progress(second, seconds)
            self._container.mux(self._video.encode(None))  # the encoder's delayed packets
        except BaseException as exc:  # handed to the decode thread at its next `add`, or to `finish`
            self._error = exc


def encode_mp4(
    frames: np.ndarray,
    audio: np.ndarray,
    sample_rate: int,
    on_progress: Progress,
    preset: str = PRESET,
    threads: int = THREADS,
) -> bytes:
    """Encode `frames` (F, H, W, 3) at `FPS` and `audio` (channels, S) float to MP4 bytes, as `Muxer` does
    when a decode hands it the same frames. Floats in [0, 1] become levels a second at a time."""
    with Muxer(
        len(frames), frames.shape[1], frames.shape[2], sample_rate, audio.shape[0], on_progress, preset, threads
    ) as muxer:
        for first in range(0, len(frames), FPS):
            muxer.add(frames[first : first + FPS])
        return muxer.finish(audio)


def _add_video(container, width: int, height: int, preset: str, threads: int):
    stream = container.add_stream("libx264", rate=FPS, options={"preset": preset})
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.codec_context.thread_count = threads
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
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples, dtype=np.float32), format="fltp", layout=stream.layout.name
    )
    frame.sample_rate, frame.pts, frame.time_base = stream.rate, first, Fraction(1, stream.rate)
    container.mux(stream.encode(frame))
