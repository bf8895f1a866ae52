"""A job store opened for one scenario and closed after it, for tests that read or damage the SQLite file."""

from __future__ import annotations

import asyncio
from pathlib import Path


def with_store(path: Path, scenario) -> None:
    """Run `await scenario(store)` on a fresh SqliteJobStore at `path`, closed afterwards."""
    from h3serve.gateway.jobs.sqlite import SqliteJobStore

    async def go():
        store = SqliteJobStore(str(path))
        try:
            await scenario(store)
        finally:
            await store.close()

    asyncio.run(go())
