"""Why a SQLite store file is refused at open, and the way out: damaged, or locked by another program.

Kept apart from database.py, which works the file: these are only the messages, with the programs holding a lock.
"""

from __future__ import annotations

import os

from h3serve.common.processes import command_line, holders_of
from h3serve.gateway.jobs.sqlite import identity

BUSY_WAIT_S = 5.0  # how long a statement waits for another program's lock on the file before it fails
SIDE_FILES = ("-wal", "-shm", "-journal")


def damaged(path: str, detail: str) -> str:
    return (
        f"job store {path} is damaged ({detail}): its jobs cannot be read. Move it aside, with its -wal and -shm "
        f"files, remove {identity.mark_path(path)} and start the gateway again: it starts a new, empty store, and "
        "the jobs in the old one are lost (`sqlite3 <old file> .recover` may save some of them)"
    )


def locked(path: str) -> str:
    holders = _holders(path)
    return (
        f"job store {path} is locked by another program: its write lock stayed taken for {BUSY_WAIT_S:g} s"
        f"{'; the file is open in ' + ', '.join(holders) if holders else ''}. Close the program holding it (a "
        "sqlite3 shell in a transaction, a backup tool) and start the gateway again"
    )


def _holders(path: str) -> list[str]:
    """Other processes with the store's files open, "pid N (command)" each: best effort (Linux /proc, this user's)."""
    files = {os.path.realpath(path + suffix) for suffix in ("", *SIDE_FILES)}
    return [f"pid {pid} ({command_line(pid)})" for pid in sorted(holders_of(files) - {os.getpid()})]
