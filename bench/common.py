"""What every benchmark shares: sizes, timing, labels (full-size random models: h3serve/runtime/random_full.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import torch

from h3serve.v1 import common_pb2, dit_pb2


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


def denoise_spec(size: Size, forwards: int) -> dit_pb2.DenoiseSpec:
    """A t2va DiT request of `size` running `forwards` transformer forwards (N steps give N-1), seed 0."""
    return dit_pb2.DenoiseSpec(height=size.height, width=size.width, num_frames=size.frames,
                               workflow=common_pb2.WORKFLOW_T2VA,
                               params=common_pb2.GenerationParams(num_inference_steps=forwards + 1, seed=0))


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def device_label(device: str, count: int = 1) -> str:
    if device.startswith("cuda"):
        return f"{count}x{torch.cuda.get_device_name().replace('NVIDIA ', '')}"
    return "cpu"


def software() -> str:
    import diffusers

    cuda = f", CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""
    return f"torch {torch.__version__}, diffusers {diffusers.__version__}{cuda}"


def add_variant_arguments(parser, sizes: str, repeats: int) -> None:
    """The arguments of a bench that times fast-path variants against diffusers in the same run."""
    parser.add_argument("--quick", action="store_true", help="tiny preset on CPU: a smoke test of the harness")
    parser.add_argument("--sizes", default=sizes)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--variants", default="native",
                        help="fast paths to time, in order, each only adding to the one before (see the docstring)")
    parser.add_argument("--errors", action="store_true", help="also measure each variant's error against fp32")


def _smi(query: str) -> list[list[int]]:
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return [[int(v) for v in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_left_behind(slack_mib: int = 1024) -> str:
    """What still holds GPU memory besides this process ("" when nothing): the compute processes nvidia-smi lists,
    and memory in use beyond this process's own (which a container's nvidia-smi may not attribute to a pid)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    apps = dict(_smi("--query-compute-apps=pid,used_memory"))
    own = apps.pop(os.getpid(), 0)
    used = [mib for (mib,) in _smi("--query-gpu=memory.used")]
    if apps or max(used) > own + slack_mib:
        return f"processes {apps or 'none listed'} (pid: MiB), GPUs use {used} MiB, this process {own} MiB"
    return ""


@contextlib.contextmanager
def gpu_peak(every_s: float = 0.5):
    """Around a part of a bench that starts processes on the GPUs: yields a list that holds, once the part ends, the
    most memory in use on each GPU while it ran (MiB, every process together, sampled every `every_s` with
    nvidia-smi), less what was in use when it began (this process's own CUDA context). Empty without nvidia-smi."""
    peaks: list[int] = []
    if shutil.which("nvidia-smi") is None:
        yield peaks
        return
    start = [mib for (mib,) in _smi("--query-gpu=memory.used")]
    highest, done = list(start), threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            with contextlib.suppress(subprocess.CalledProcessError, ValueError):
                used = [mib for (mib,) in _smi("--query-gpu=memory.used")]
                # a reading that misses a GPU (nvidia-smi failed or was cut short) is skipped: zipped in, it
                # would have dropped the peaks of the GPUs it missed
                if len(used) == len(highest):
                    highest[:] = [max(h, mib) for h, mib in zip(highest, used)]

    sampler = threading.Thread(target=sample, name="gpu-peak", daemon=True)
    sampler.start()
    try:
        yield peaks
    finally:
        done.set()
        sampler.join()
        peaks.extend(h - s for h, s in zip(highest, start))


@contextlib.contextmanager
def leaves_gpu_empty(limit_s: float = 30.0):
    """Around a part of a bench that starts processes on the GPU: once it ends, none of them may still hold
    memory (a rank orphaned by a stop once kept 67 GiB and the next run failed out of memory)."""
    yield
    deadline = time.monotonic() + limit_s
    while (held := gpu_left_behind()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if held:
        raise RuntimeError(f"GPU memory still held {limit_s:.0f} s after the bench stopped its processes: {held}")
    if shutil.which("nvidia-smi"):
        used = [mib for (mib,) in _smi("--query-gpu=memory.used")]
        print(f"GPU empty after the bench: no other compute process, {used} MiB in use", flush=True)
