"""Sanity checks on decoded output before it is muxed.

A numerically broken decode (fp16 overflow, in the field) produced an all-black video with NaN audio
while the process exited 0; these checks turn such output into an error instead of a file. They run
where the decode left the tensors (the VAE's device), so only their verdict crosses to the CPU.
"""

from __future__ import annotations

import torch


class InvalidOutput(ValueError):
    """Decoded frames or audio that cannot be a real generation."""


def validate(frames: torch.Tensor, audio: torch.Tensor) -> None:
    """Raise `InvalidOutput` for non-finite frames, a constant video or non-finite audio.

    `frames` is (F, H, W, C) with channels last (any strides); `audio` has any shape.
    """
    bad = _non_finite(frames)
    if bad:
        raise InvalidOutput(f"video: {bad} of {frames.numel()} frame values are NaN or infinite")
    pixels = (0, 1, 2)  # finite values: a channel varies exactly when its extremes differ
    if not torch.ne(frames.amax(dim=pixels), frames.amin(dim=pixels)).any():
        color = ", ".join(f"{v:.4g}" for v in frames[0, 0, 0].tolist())
        raise InvalidOutput(f"video: constant, every pixel of all {frames.shape[0]} frames is ({color})")
    bad = _non_finite(audio)
    if bad:
        raise InvalidOutput(f"audio: {bad} of {audio.numel()} samples are NaN or infinite")


def _non_finite(values: torch.Tensor) -> int:
    """How many values are NaN or infinite. A sum is NaN or infinite when any term is, so finite output
    (the usual case) costs one reduction; only a non-finite sum pays for the elementwise count."""
    if torch.isfinite(values.sum()):
        return 0
    return int(torch.count_nonzero(~torch.isfinite(values)))
