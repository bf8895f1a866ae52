"""What a box offers a deployment: its GPUs (memory as CUDA reports it, compute capability), host memory, free disk.

`h3serve init` (h3serve/cli/init.py) chooses a deployment profile for it. Read from this machine (nvidia-smi, else
torch where it is installed; /proc/meminfo; the free space under the directory the deployment is written to) or from
a description file (`--box FILE`, JSON or TOML), which also lets a box be planned from another machine:

    {"gpus": [{"memory_gib": 79.2, "capability": "9.0", "count": 1}], "host_gib": 125, "disk_gib": 500}

A GPU's memory is what CUDA reports as its total, a little under the card's label (an H100 80 GB: 79.2 GiB): what the
memory plan checks the processes against. nvidia-smi's `memory.total` counts what the driver reserves too, so that
part is taken off.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from h3serve.common.config import ConfigError, DeployConfig
from h3serve.common.processes import GIB, MEMINFO, read_meminfo

NVIDIA_SMI = ("nvidia-smi", "--format=csv,noheader,nounits")
# MiB, MiB, "9.0"; a driver that knows no memory.reserved refuses the query, and is asked without it
FIELDS = ("memory.total,memory.reserved,compute_cap", "memory.total,compute_cap")
MIB = 1 << 20
CARD_ROUNDING = 1.01  # a declared card this much over the one read still starts: both are rounded, read two ways


class BoxError(ValueError):
    """A box description that cannot be read; the message says what is wrong."""


@dataclass(frozen=True)
class Gpu:
    memory_gib: float  # as CUDA reports the card's total
    capability: tuple[int, int]

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True)
class Box:
    gpus: tuple[Gpu, ...]
    host_gib: float
    disk_gib: float  # free, where the deployment's caches go
    source: str  # where the description comes from
    here: bool = False  # this machine: what its cache directories already hold can be measured

    def held_gib(self, directory: str) -> float:
        """What `directory` (a cache's; a relative one from here, as `h3serve up` run here resolves it) already
        holds on this machine: a restart reuses those files, so they are room for that cache as much as free space
        is. 0 for a described box, which has no directories to measure."""
        path = Path(directory)
        if not self.here or not path.is_dir():
            return 0.0
        return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) / GIB

    def describe(self) -> str:
        kinds = {(gpu.memory_gib, gpu.sm) for gpu in self.gpus}
        cards = ", ".join(
            f"{sum(1 for g in self.gpus if (g.memory_gib, g.sm) == kind)} x {kind[0]:g} GiB {kind[1]}"
            for kind in sorted(kinds)
        )
        return (
            f"{len(self.gpus)} GPU(s) ({cards or 'none'}), host {self.host_gib:g} GiB, "
            f"{self.disk_gib:g} GiB of disk free ({self.source})"
        )


def capability(value) -> tuple[int, int]:
    """ "9.0", 9.0, "sm_90", "90" or [9, 0] as (9, 0)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    text = str(value).strip().lower().removeprefix("sm_")
    major, dot, minor = text.partition(".")
    if dot and major.isdigit() and minor.isdigit():
        return int(major), int(minor)
    if text.isdigit() and len(text) >= 2:
        return int(text[:-1]), int(text[-1])
    raise BoxError(f'a compute capability is "9.0", "sm_90" or [9, 0], got {value!r}')


def from_description(data: dict, source: str) -> Box:
    """A box from a description's fields (module docstring); BoxError naming what is missing or wrong."""
    try:
        gpus = tuple(
            Gpu(float(entry["memory_gib"]), capability(entry["capability"]))
            for entry in data.get("gpus", [])
            for _ in range(int(entry.get("count", 1)))
        )
        return Box(gpus, float(data["host_gib"]), float(data["disk_gib"]), source)
    except (KeyError, TypeError, ValueError) as exc:
        raise BoxError(
            f"{source}: a box is gpus [{{memory_gib, capability, count}}], host_gib and disk_gib: {exc!r}"
        ) from None


def read_file(path: str | Path) -> Box:
    """A box description file: JSON, or TOML (by its suffix)."""
    text = Path(path).read_text()
    try:
        data = tomllib.loads(text) if str(path).endswith(".toml") else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise BoxError(f"{path}: {exc}") from None
    return from_description(data, str(path))


def parse_nvidia_smi(output: str) -> tuple[Gpu, ...]:
    """nvidia-smi's `--query-gpu` CSV of FIELDS (no header, no units), one GPU a line: total and reserved MiB (or the
    total alone) and the compute capability."""
    gpus = []
    for line in output.strip().splitlines():
        *memory, cap = (field.strip() for field in line.split(","))
        total, reserved = int(memory[0]), int(memory[1]) if len(memory) > 1 else 0
        gpus.append(Gpu(round((total - reserved) * MIB / GIB, 1), capability(cap)))
    return tuple(gpus)


def smi_gpus() -> tuple[Gpu, ...] | None:
    """This machine's GPUs as nvidia-smi lists them; None without a working nvidia-smi (no torch is imported)."""
    for fields in FIELDS if shutil.which(NVIDIA_SMI[0]) else ():
        done = subprocess.run([*NVIDIA_SMI, f"--query-gpu={fields}"], capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return parse_nvidia_smi(done.stdout)
    return None


def machine_gpus() -> tuple[tuple[Gpu, ...], str]:
    """This machine's GPUs and how they were read: nvidia-smi, else torch (where installed), else none."""
    if (listed := smi_gpus()) is not None:
        return listed, "nvidia-smi"
    try:
        import torch
    except ImportError:
        return (), "no nvidia-smi, no torch"
    if not torch.cuda.is_available():
        return (), "torch sees no CUDA device"
    props = [torch.cuda.get_device_properties(index) for index in range(torch.cuda.device_count())]
    return tuple(Gpu(round(p.total_memory / GIB, 1), (p.major, p.minor)) for p in props), "torch"


def card_problem(declared_gib: float, gpus: tuple[Gpu, ...]) -> str | None:
    """Why a deployment planned for cards of `declared_gib` (`[supervisor] gpu_memory_gib`) must not start beside
    `gpus` (this machine's): it names a card larger than any here, so its plan would admit requests, and place
    weights, that run out of memory (a file written for an H200, started on an H100, failed at load with CUDA's
    out-of-memory). None where it names none, no GPU is seen, or a card here is as large (within rounding)."""
    if not declared_gib or not gpus:
        return None
    largest = max(gpu.memory_gib for gpu in gpus)
    if declared_gib <= largest * CARD_ROUNDING:
        return None
    return (
        f"[supervisor] gpu_memory_gib is {declared_gib:g} GiB, but this machine's largest GPU has {largest:g} GiB "
        "(nvidia-smi): its plan would admit what does not fit. Write a deployment for this box with `h3serve init`, "
        "or set gpu_memory_gib to the card's size and check it with `h3serve plan`"
    )


def require_the_card(config: DeployConfig, path: str | None, on_gpu: bool) -> None:
    """ConfigError (`card_problem`'s reason) where a start that puts a model service on a GPU (`on_gpu`) finds this
    machine's cards smaller than the deployment was planned for: `h3serve up` before it starts anything, `h3serve
    serve` (a unit per service) before its service loads."""
    if on_gpu and (problem := card_problem(config.supervisor.gpu_memory_gib, smi_gpus() or ())):
        raise ConfigError(f"{path or 'the deployment'}: {problem}")


def free_disk_gib(directory: str | Path) -> float:
    """Free space under `directory`, or its nearest existing parent (it may not exist yet)."""
    path = Path(directory).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / GIB


def read_machine(disk_dir: str | Path, meminfo: str = MEMINFO) -> Box:
    gpus, how = machine_gpus()
    memory = read_meminfo(meminfo)
    if memory is None:
        raise BoxError(f"{meminfo}: host memory unknown: describe the box with --box FILE")
    return Box(gpus, round(memory.total / GIB, 1), round(free_disk_gib(disk_dir), 1), f"this machine: {how}", True)
