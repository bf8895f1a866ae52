"""Artifact files on disk, written atomically so a crash never leaves a truncated file under a final name.

A write that meets a full disk removes its partial file and raises DiskFull naming the artifacts' directory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable

from h3serve.common.disk import full_named
from h3serve.v1 import gateway_pb2

# kind -> (file extension, media type)
KINDS = {"video": (".mp4", "video/mp4"), "raw": (".npz", "application/x-npz")}

BytesLike = bytes | bytearray | memoryview


class ArtifactStore:
    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def save(self, job_id: str, kind: str, data: BytesLike | Iterable[BytesLike]) -> tuple[gateway_pb2.Artifact, str]:
        """Write `data` (bytes or an iterable of byte chunks) as the job's `kind` artifact; returns it and its path."""
        if kind not in KINDS:
            raise ValueError(f"artifact kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if os.sep in job_id or (os.altsep and os.altsep in job_id):
            raise ValueError(f"job id must not contain a path separator, got {job_id!r}")
        extension, media_type = KINDS[kind]
        file_name = f"h3-{job_id}{extension}"
        path = os.path.join(self.root, file_name)
        chunks = [data] if isinstance(data, BytesLike) else data
        with full_named(self.root):
            digest, size = _write_atomically(path, chunks)
        artifact = gateway_pb2.Artifact(
            artifact_id=f"{job_id}-{kind}", file_name=file_name, bytes=size, sha256=digest, media_type=media_type
        )
        return artifact, path


def remove(path: str) -> None:
    """Delete an artifact's file; one already gone is no error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_atomically(path: str, chunks: Iterable[BytesLike]) -> tuple[str, int]:
    """Write to a temporary file beside `path`, fsync, then rename over it; returns (sha256 hex, size)."""
    directory = os.path.dirname(path)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".part")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                digest.update(chunk)
                size += out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    _fsync_dir(directory)  # makes the rename itself durable
    return digest.hexdigest(), size


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
