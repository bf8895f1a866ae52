"""Where artifacts and uploads live: named blobs behind one small interface, so that every gateway sees the same ones.

A blob is named by a key, a relative name such as `artifacts/h3-<job>.mp4`; the job store records keys, never local
paths. The one implementation is a directory (`[gateway] blob_dir`, data_dir by default): several gateways point it
at one shared filesystem (NFS, a Kubernetes ReadWriteMany volume). A blob is written to a temporary name beside its
final one, fsynced, then renamed into place, so a reader on any gateway sees the whole blob or none of it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from typing import BinaryIO, Protocol

from h3serve.common.disk import full_named

BytesLike = bytes | bytearray | memoryview


class Blobs(Protocol):
    def put(self, key: str, data: BytesLike | Iterable[BytesLike]) -> tuple[str, int]:
        """Store `data` (bytes or an iterable of byte chunks: `chunks_of` a file) under `key`, replacing any blob
        there only once it is whole; returns (sha256 hex, size). A full disk raises DiskFull naming it, and leaves
        nothing behind."""

    def open(self, key: str) -> BinaryIO:
        """The blob for reading. FileNotFoundError: no such blob."""

    def size(self, key: str) -> int:
        """Its size in bytes. FileNotFoundError: no such blob."""

    def modified(self, key: str) -> float:
        """When it was stored (unix seconds). FileNotFoundError: no such blob."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Remove the blob; one already gone is no error."""

    def keys(self, prefix: str) -> list[str]:
        """The keys of the blobs directly under `prefix` (a key ending in "/")."""

    def disk(self, prefix: str) -> str:
        """A local directory on the disk that holds the blobs under `prefix`: what a full disk's messages name."""


def chunks_of(file: BinaryIO, chunk_bytes: int = 1 << 20) -> Iterable[bytes]:
    """A file's bytes as chunks, for `Blobs.put` (iterating a binary file would split it at newlines)."""
    while data := file.read(chunk_bytes):
        yield data


class DirectoryBlobs:
    """Blobs as files under one directory: a key is a path relative to it, with no `..` and not absolute."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def path(self, key: str) -> str:
        """The file of `key`. ValueError: a key that is empty, absolute or leaves the directory."""
        parts = key.split("/")
        if any(part in ("", ".", "..") for part in parts):  # also "" and "/...": a first part that is empty
            raise ValueError(f"a blob key is a relative name inside the blob directory, got {key!r}")
        return os.path.join(self.root, *parts)

    def put(self, key: str, data: BytesLike | Iterable[BytesLike]) -> tuple[str, int]:
        path = self.path(key)
        directory = os.path.dirname(path)
        chunks = [data] if isinstance(data, BytesLike) else data
        with full_named(directory):
            os.makedirs(directory, exist_ok=True)
            return _write_atomically(path, chunks)

    def open(self, key: str) -> BinaryIO:
        return open(self.path(key), "rb")

    def size(self, key: str) -> int:
        return os.path.getsize(self.path(key))

    def modified(self, key: str) -> float:
        return os.path.getmtime(self.path(key))

    def exists(self, key: str) -> bool:
        try:
            return os.path.isfile(self.path(key))
        except ValueError:  # a key no blob can have: no such blob
            return False

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def keys(self, prefix: str) -> list[str]:
        directory = self.path(prefix.rstrip("/"))
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        return [prefix + name for name in names if not name.startswith(".")]  # "." names: writes in progress

    def disk(self, prefix: str) -> str:
        return self.path(prefix.rstrip("/"))


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
