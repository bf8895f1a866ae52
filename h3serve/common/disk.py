"""A full disk, recognised in one place: the OS's ENOSPC and EDQUOT, and SQLite's SQLITE_FULL ("database or disk is
full").

Every write of the gateway (the job store, artifacts, uploads, the HTTP door's spooled uploads) turns one into
DiskFull, whose message names the directory, its file system and the space left there. Callers get it as
RESOURCE_EXHAUSTED (HTTP 507, never retried blindly: the space comes back only when someone frees it); nothing
stays half-written, and the next write after space returns succeeds, without a restart.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
MARK = "disk full"  # every DiskFull message starts with it: the HTTP door tells a full disk from a full queue by it
_UNITS = ("KiB", "MiB", "GiB", "TiB")


class DiskFull(Exception):
    """A write under `directory` failed for want of space (or of quota)."""

    def __init__(self, directory: str, cause: BaseException) -> None:
        super().__init__(f"{MARK}: {directory} ({_space(directory)}): {_reason(cause)}; free space there and try again")


def is_full(exc: BaseException) -> bool:
    """Whether `exc` is a write that failed for want of space: ENOSPC or EDQUOT, or SQLite's SQLITE_FULL."""
    if isinstance(exc, OSError):
        return exc.errno in FULL_ERRNOS
    # the primary code: SQLite's extended codes keep it in their low byte
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL


@contextmanager
def full_named(directory: str) -> Iterator[None]:
    """Around writes under `directory`: a full disk met inside is raised as DiskFull naming it; any other error
    passes unchanged."""
    try:
        yield
    except Exception as exc:
        if is_full(exc):
            raise DiskFull(directory, exc) from exc
        raise


def space_wanted(directory: str, needed: int) -> str:
    """Where a write waits for space, what is free there and what it needs: "disk full: DIR (N MiB free of M MiB on
    the file system mounted at MOUNT): N MiB needed"."""
    return f"{MARK}: {directory} ({_space(directory)}): {readable_size(needed)} needed"


def _reason(cause: BaseException) -> str:
    return cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)


def _space(directory: str) -> str:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return "its file system's free space unknown"
    free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    return (
        f"{readable_size(free)} free of {readable_size(total)} on the file system mounted at {_mount_point(directory)}"
    )


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def readable_size(count: int) -> str:
    value, unit = float(count), "bytes"
    for larger in _UNITS:
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
