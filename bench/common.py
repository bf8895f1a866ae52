"""What every benchmark shares: sizes, timing, labels (full-size random models: h3serve/runtime/random_full.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3serve.v1 import common_pb2, dit_pb2


@dataclass(frozen=True)
class Size:
    height: int
    width: int
    frames: int

    @classmethod
    def parse(cls, text: str) -> Size:
        height, width, frames = (int(v) for v in text.split("x"))
        return cls(height, width, frames)

    def __str__(self) -> str:
        return f"{self.height}x{self.width}x{self.frames}"


def denoise_spec(size: Size, forwards: int) -> dit_pb2.DenoiseSpec:
    """A t2va DiT request of `size` running `forwards` transformer forwards (N steps give N-1), seed 0."""
    return dit_pb2.DenoiseSpec(
        height=size.height,
        width=size.width,
        num_frames=size.frames,
        workflow=common_pb2.WORKFLOW_T2VA,
        params=common_pb2.GenerationParams(num_inference_steps=forwards + 1, seed=0),
    )


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
    parser.add_argument(
        "--variants",
        default="native",
        help="fast paths to time, in order, each only adding to the one before (see the docstring)",
    )
    parser.add_argument(
        "--errors",
        nargs="?",
        const="fp32",
        choices=("fp32", "bf16"),
        help="also measure each variant's error against fp32 (bf16: against the bf16 eager forward only, where the "
        "card cannot hold an fp32 copy of the model)",
    )


def _smi(query: str) -> list[list[int]]:
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    ).stdout
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


@dataclass
class GpuPeak:
    """What `gpu_peak` saw: per GPU the most memory in use (MiB, every process together) less what was in use when it
    began, and when the fullest GPU reached it with the compute processes nvidia-smi listed then (pid: MiB; a
    container's nvidia-smi may list none), so a peak can be charged to a phase and a process."""

    mib: list[int] = field(default_factory=list)
    at_s: float = 0.0  # seconds after the part began
    apps: dict[int, int] = field(default_factory=dict)
    # each compute process's own peak (pid: MiB) whenever it was, and its lineage (itself, then its ancestors) as read
    # when it was first seen: what `h3serve plan` adds up is each process's peak, not the moment they peaked together
    processes: dict[int, int] = field(default_factory=dict)
    lineage: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def describe(self) -> str:
        listed = ", ".join(f"pid {pid} {mib / 1024:.1f} GiB" for pid, mib in sorted(self.apps.items()))
        return f"reached {self.at_s:.0f} s after the start" + (f" ({listed})" if listed else "")

    def by_process(self, names: dict[int, str]) -> dict[str, float]:
        """Each process's own peak in GiB, named by the first of its lineage in `names` (a DiT rank by its launcher's
        name; a name that repeats gets the pid); processes outside `names` are left out."""
        peaks: dict[str, float] = {}
        for pid, mib in sorted(self.processes.items()):
            name = next((names[p] for p in self.lineage.get(pid, (pid,)) if p in names), None)
            if name is not None:
                peaks[f"{name} {pid}" if name in peaks else name] = round(mib / 1024, 2)
        return peaks


def _lineage(pid: int) -> tuple[int, ...]:
    """pid, its parent, its parent's parent ... as /proc has them now (stops where /proc cannot say)."""
    found = [pid]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        while found[-1] > 1 and len(found) < 16:
            status = Path(f"/proc/{found[-1]}/status").read_text()
            found.append(int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1]))
    return tuple(found)


def _apps() -> dict[int, int]:
    with contextlib.suppress(subprocess.CalledProcessError, ValueError, TypeError):
        return {pid: mib for pid, mib in _smi("--query-compute-apps=pid,used_memory")}
    return {}


@contextlib.contextmanager
def gpu_peak(every_s: float = 0.5):
    """Around a part of a bench that starts processes on the GPUs: yields a GpuPeak, filled once the part ends with
    the most memory in use on each GPU while it ran (sampled every `every_s` with nvidia-smi), less what was in use
    when it began (this process's own CUDA context). Empty without nvidia-smi."""
    peak = GpuPeak()
    if shutil.which("nvidia-smi") is None:
        yield peak
        return
    start = [mib for (mib,) in _smi("--query-gpu=memory.used")]
    highest, done, began = list(start), threading.Event(), time.monotonic()
    moment = GpuPeak()

    def sample() -> None:
        while not done.wait(every_s):
            with contextlib.suppress(subprocess.CalledProcessError, ValueError):
                used = [mib for (mib,) in _smi("--query-gpu=memory.used")]
                # a reading that misses a GPU (nvidia-smi failed or was cut short) is skipped: zipped in, it
                # would have dropped the peaks of the GPUs it missed
                if len(used) != len(highest):
                    continue
                apps = _apps()
                if max(used) > max(highest):
                    moment.at_s, moment.apps = time.monotonic() - began, apps
                highest[:] = [max(h, mib) for h, mib in zip(highest, used, strict=True)]
                for pid, mib in apps.items():
                    peak.processes[pid] = max(mib, peak.processes.get(pid, 0))
                    if pid not in peak.lineage:
                        peak.lineage[pid] = _lineage(pid)

    sampler = threading.Thread(target=sample, name="gpu-peak", daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        peak.mib.extend(h - s for h, s in zip(highest, start, strict=True))
        peak.at_s, peak.apps = moment.at_s, moment.apps


@dataclass(frozen=True)
class ProcMemory:
    """A process's resident memory by kind (kB), from /proc/<pid>/status."""

    anon_kib: int  # RssAnon: heap, tensors in host memory, pinned buffers
    file_kib: int  # RssFile: mapped file pages (safetensors, libraries): page cache, reclaimable
    shmem_kib: int  # RssShmem: shared memory (tmpfs, /dev/shm, CUDA IPC), as unreclaimable as anon

    @property
    def private_kib(self) -> int:
        """What the kernel cannot drop: the OOM killer's anon-rss (RssAnon + RssShmem)."""
        return self.anon_kib + self.shmem_kib


def parse_status(text: str) -> ProcMemory | None:
    """/proc/<pid>/status's Rss lines; None without all three (a torn read, a kernel thread, a zombie)."""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return ProcMemory(*(int(fields[key].split()[0]) for key in ("RssAnon", "RssFile", "RssShmem")))
    except (KeyError, IndexError, ValueError):
        return None


def parse_meminfo(text: str) -> int | None:
    """The system's used memory (kB) from /proc/meminfo: MemTotal - MemAvailable; None on a torn read."""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])
    except (KeyError, IndexError, ValueError):
        return None


def _read(path: str) -> str | None:
    """A /proc file's text; None once its process is gone (listed a moment ago, vanished since)."""
    try:
        with open(path) as file:
            return file.read()
    except OSError:  # FileNotFoundError, and ProcessLookupError (ESRCH) from a process exiting mid-read
        return None


def process_tree(roots: Iterable[int], proc: str = "/proc") -> set[int]:
    """`roots` and every descendant, from each thread's children file (a thread's children are listed there)."""
    found, pending = set(), list(roots)
    while pending:
        pid = pending.pop()
        if pid in found:
            continue
        found.add(pid)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"{proc}/{pid}/task"):
                pending += [int(child) for child in (_read(f"{proc}/{pid}/task/{task}/children") or "").split()]
    return found


def tree_memory(roots: Iterable[int], proc: str = "/proc") -> ProcMemory:
    """The memory of every process in the trees of `roots` together; a process gone or torn meanwhile counts 0."""
    each = [parse_status(_read(f"{proc}/{pid}/status") or "") for pid in process_tree(roots, proc)]
    each = [memory for memory in each if memory]
    return ProcMemory(*(sum(getattr(m, key) for m in each) for key in ("anon_kib", "file_kib", "shmem_kib")))


@dataclass
class HostPeak:
    """The most host memory the sampled processes held together (GiB); each peak on its own (they need not
    coincide). `samples` counts the readings taken, so a test can wait for one."""

    private_gib: float = 0.0  # RssAnon + RssShmem: what the OOM killer counts
    file_gib: float = 0.0  # RssFile: mapped file pages, page cache the kernel can drop under pressure
    used_gib: float = 0.0  # the whole system's MemTotal - MemAvailable, less what it was at the start
    samples: int = 0

    def describe(self) -> str:
        return (
            f"host {self.private_gib:.1f} GiB private (+{self.file_gib:.1f} mapped files), "
            f"system used +{self.used_gib:.1f} GiB"
        )


@contextlib.contextmanager
def host_peak(roots: Callable[[], Iterable[int]], every_s: float = 0.5, proc: str = "/proc"):
    """Around a part of a bench that starts processes: yields a HostPeak of the process trees of `roots()` (asked at
    every sample, so processes started after the part began are counted: their start-up too), read every
    `every_s` from /proc; the peaks are filled as it goes and final once the part ends."""
    peak, done = HostPeak(), threading.Event()
    start_used = parse_meminfo(_read(f"{proc}/meminfo") or "")

    def sample() -> None:
        while True:
            memory, used = tree_memory(roots(), proc), parse_meminfo(_read(f"{proc}/meminfo") or "")
            peak.private_gib = max(peak.private_gib, memory.private_kib / 2**20)
            peak.file_gib = max(peak.file_gib, memory.file_kib / 2**20)
            if used is not None and start_used is not None:
                peak.used_gib = max(peak.used_gib, (used - start_used) / 2**20)
            peak.samples += 1
            if done.wait(every_s):
                return

    sampler = threading.Thread(target=sample, name="host-peak", daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


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
