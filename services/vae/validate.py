"""Sanity checks on decoded output before it is muxed.

A numerically broken decode (fp16 overflow, in the field) produced an all-black video with NaN audio
while the process exited 0; these checks turn such output into an error instead of a file.
"""

from __future__ import annotations

import numpy as np


class InvalidOutput(ValueError):
    """Decoded frames or audio that cannot be a real generation."""


def validate(frames: np.ndarray, audio: np.ndarray) -> None:
    """Raise `InvalidOutput` for non-finite frames, a constant video or non-finite audio.

    `frames` is (F, H, W, C) with channels last; `audio` has any shape.
    """
    bad = np.count_nonzero(~np.isfinite(frames))
    if bad:
        raise InvalidOutput(f"video: {bad} of {frames.size} frame values are NaN or infinite")
    pixels = frames.reshape(-1, frames.shape[-1])
    if not np.ptp(pixels, axis=0).any():
        color = ", ".join(f"{v:.4g}" for v in pixels[0])
        raise InvalidOutput(f"video: constant, every pixel of all {frames.shape[0]} frames is ({color})")
    bad = np.count_nonzero(~np.isfinite(audio))
    if bad:
        raise InvalidOutput(f"audio: {bad} of {audio.size} samples are NaN or infinite")
