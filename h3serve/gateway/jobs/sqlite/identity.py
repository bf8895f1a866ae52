"""The job store knows it existed: a store id kept in the file and in a mark file beside it.

A data directory that held a store and now holds a missing, empty or foreign one is refused (Refused: exit 78,
naming the file, the store expected and the way out) instead of started anew: a store truncated to 0 bytes once
came back SERVING with none of its jobs and no line in the log (issue 51). A fresh directory needs no step: no
mark and no file is a new store, and the log says so. A file without a mark (written before the mark existed,
or whose mark was removed to keep it) is adopted: the mark is written from the file's id.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable

from h3serve.common.processes import Refused

log = logging.getLogger("h3serve.gateway.jobs")
MARK_SUFFIX = ".id"  # jobs.sqlite -> jobs.sqlite.id

Rows = Callable[[str], list[tuple]]


def mark_path(path: str) -> str:
    return path + MARK_SUFFIX


def expected_id(path: str) -> str:
    """The id of the store this directory held ("" when it never held one); refuses, before the file is opened (an
    open would create it), a store whose file is missing or empty."""
    try:
        with open(mark_path(path), encoding="utf-8") as file:
            store_id = file.read().strip()
    except FileNotFoundError:
        return ""
    if not os.path.exists(path):
        raise Refused(_not_here(path, store_id, "is missing"))
    if os.path.getsize(path) == 0:
        raise Refused(_not_here(path, store_id, "is empty (0 bytes)"))
    return store_id


def stored_id(rows: Rows) -> str | None:
    """The file's own store id; None for a file without one (no tables at all, or from before the id)."""
    if not rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'store'"):
        return None
    found = rows("SELECT store_id FROM store")
    return found[0][0] if found else None


def has_jobs_table(rows: Rows) -> bool:
    return bool(rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'"))


def check(path: str, expected: str, found: str | None, had_jobs: bool) -> None:
    """Refuses a file that is not the store the mark names: one without tables (emptied), or another store."""
    if not expected or found == expected:
        return
    if found is None and not had_jobs:
        raise Refused(_not_here(path, expected, "holds no tables (an empty database)"))
    what = f"is store {found}" if found else "is a store without an id"
    raise Refused(
        f"job store {path} {what}, not store {expected} that {mark_path(path)} says this directory held: it is "
        f"another directory's store, or an old copy. Put this directory's own store back and start the gateway "
        f"again; to keep this one instead, remove {mark_path(path)} (this store's id is then taken as this "
        "directory's)"
    )


def new_id() -> str:
    return uuid.uuid4().hex


def adopt(path: str, store_id: str, created_now: bool) -> None:
    """Write the mark for the file's id (flushed to disk before the store serves), and say in the log when this
    directory starts a new store or takes an existing file as its own."""
    _write_durably(mark_path(path), store_id + "\n")
    if created_now:
        directory = os.path.dirname(path)
        log.info("job store %s: a new, empty store %s (no store was in %s before)", path, store_id, directory)
    else:
        log.info("job store %s: store %s taken as this directory's (%s written)", path, store_id, mark_path(path))


def _write_durably(path: str, text: str) -> None:
    partial = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _not_here(path: str, store_id: str, what: str) -> str:
    return (
        f"job store {path} {what}, but {mark_path(path)} says this directory held store {store_id}: its jobs are "
        f"not here. Put the store's file back (with its -wal and -shm files, from where it was moved or from a "
        f"backup) and start the gateway again; to start a new, empty store here instead, remove {mark_path(path)}"
    )
