"""This gateway's name on the jobs it holds (store.py's Lease): kept in its data_dir, so a restart knows its own
earlier leases and takes those jobs back at once (JobRunner.resume) instead of waiting for them to run out.

One gateway owns a data_dir at a time (its lock), so the id names one gateway; two gateways sharing a PostgreSQL
store each have their own data_dir, and so their own ids.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

FILE_NAME = "gateway.id"


def gateway_id(data_dir: Path) -> str:
    """The id in `data_dir`, made (and written durably) the first time."""
    path = data_dir / FILE_NAME
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        pass
    made = f"{os.uname().nodename}-{uuid.uuid4().hex[:12]}"
    partial = path.with_suffix(".tmp")
    with open(partial, "w", encoding="utf-8") as file:
        file.write(made + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    return made
