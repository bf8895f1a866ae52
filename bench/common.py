"""What every benchmark shares: sizes, full-size random models on the GPU, timing, labels."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Size:
    height: int
    width: int
    frames: int

    @classmethod
    def parse(cls, text: str) -> "Size":
        height, width, frames = (int(v) for v in text.split("x"))
        return cls(height, width, frames)

    def __str__(self) -> str:
        return f"{self.height}x{self.width}x{self.frames}"


def full_size(model_class, device: str, dtype: torch.dtype):
    """`model_class` at its released (default) config with random weights, built in place on
    `device` in `dtype`; parameters named in `_keep_in_fp32_modules` are fp32, as loading keeps them."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class().eval()
    finally:
        torch.set_default_dtype(previous)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        if keep & set(name.split(".")):
            param.data = param.data.float()
    return model


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return f"1x{torch.cuda.get_device_name().replace('NVIDIA ', '')}"
    return "cpu"


def software() -> str:
    import diffusers

    cuda = f", CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""
    return f"torch {torch.__version__}, diffusers {diffusers.__version__}{cuda}"
