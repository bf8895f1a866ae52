"""CUDA binaries compiled at first use by NVRTC and kept on disk, so a pip install needs no nvcc and no build step.

torch's CUDA wheels install NVRTC (`nvidia-cuda-nvrtc`) and `cuda-bindings`, which compile CUDA C++ with no GPU
and no toolkit. A target is `sm_XY` (a CUBIN for that architecture) or `compute_XY` (PTX, which the driver
JIT-compiles for the card at load time: how the Turing code path is checked on a newer GPU).

The cache file is keyed by the source's hash, the target and NVRTC's version, so a new kernel, another card or
another NVRTC never reads a stale binary. It is written whole (a temporary file, fsync, rename, the directory
synced) and starts with the SHA-256 of what follows, checked when read: a torn or damaged file is set aside
(renamed `.damaged-<UTC time>`, kept for a look) and the binary compiled again, never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  # its import loads the NVRTC of torch's CUDA wheel, which cuda-bindings then uses

log = logging.getLogger("h3serve.nvrtc_cache")
DIRECTORY_ENV = "H3SERVE_KERNEL_CACHE"  # overrides the directory below
TARGET = re.compile(r"^(sm|compute)_(\d+)$")
DIGEST = hashlib.sha256().digest_size


def default_directory() -> Path:
    """$H3SERVE_KERNEL_CACHE, else the user's cache ($XDG_CACHE_HOME or ~/.cache) /h3serve/kernels."""
    if override := os.environ.get(DIRECTORY_ENV):
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "h3serve" / "kernels"


@dataclass(frozen=True)
class Binary:
    image: bytes  # a CUBIN, or NUL-terminated PTX text (what cuModuleLoadData takes)
    target: str
    path: Path  # where it is cached
    compile_s: float | None  # seconds NVRTC took now; None when read from the cache

    def origin(self) -> str:
        if self.compile_s is None:
            return f"read from the cache {self.path}"
        return f"compiled now by NVRTC in {self.compile_s:.1f} s (cached at {self.path})"


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    major, minor = _checked(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def supported_architectures() -> list[int]:
    from cuda.bindings import nvrtc

    return list(_checked(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")[0])


def cache_path(directory: Path, name: str, source: bytes, target: str, version: str) -> Path:
    key = hashlib.sha256(b"\0".join([source, target.encode(), version.encode()])).hexdigest()[:20]
    suffix = "cubin" if target.startswith("sm_") else "ptx"
    return directory / f"{name}-{target}-nvrtc{version}-{key}.{suffix}"


def load(
    name: str,
    source: bytes,
    target: str,
    directory: Path | None = None,
    version: str | None = None,
    compiler: Callable[[str, bytes, str], bytes] | None = None,
) -> Binary:
    """The binary of `source` for `target`, from the cache when a whole file is there, else compiled and cached."""
    if not TARGET.match(target):
        raise ValueError(f"NVRTC target {target!r}: expected sm_XY (CUBIN) or compute_XY (PTX)")
    path = cache_path(directory or default_directory(), name, source, target, version or nvrtc_version())
    if (image := _read(path)) is not None:
        return Binary(image, target, path, None)
    started = time.monotonic()
    image = (compiler or compile_source)(name, source, target)
    seconds = time.monotonic() - started
    _write(path, image)
    return Binary(image, target, path, seconds)


def compile_source(name: str, source: bytes, target: str) -> bytes:
    """NVRTC's CUBIN (sm_XY) or PTX (compute_XY) of `source`; RuntimeError with NVRTC's log on failure."""
    from cuda.bindings import nvrtc

    (program,) = _checked(nvrtc.nvrtcCreateProgram(source, f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={target}".encode(), b"--std=c++17"]
        (result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            (size,) = _checked(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            text = b" " * size
            _checked(nvrtc.nvrtcGetProgramLog(program, text), "nvrtcGetProgramLog")
            raise RuntimeError(f"NVRTC could not compile {name} for {target}: {text.decode(errors='replace')}")
        cubin = target.startswith("sm_")
        get_size, get = (
            (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        )
        (size,) = _checked(get_size(program), get_size.__name__)
        image = b" " * size
        _checked(get(program, image), get.__name__)
        return image  # the PTX size counts its terminating NUL, which cuModuleLoadData needs
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _checked(result: tuple, call: str) -> tuple:
    """cuda-bindings return (status, *values): the values, or RuntimeError naming the call and status."""
    status, *values = result
    if int(status) != 0:
        raise RuntimeError(f"{call} failed: {status!r}")
    return tuple(values)


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    digest, image = data[:DIGEST], data[DIGEST:]
    if len(data) > DIGEST and hashlib.sha256(image).digest() == digest:
        return image
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.replace(path, aside)
    log.error("kernel cache file %s is damaged (checksum): moved to %s, compiling again", path, aside)
    return None


def _write(path: Path, image: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(hashlib.sha256(image).digest() + image)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # makes the rename itself durable
    finally:
        os.close(directory)
