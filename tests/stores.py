"""Job stores for tests: a SQLite store opened for one scenario (for tests that read or damage its file), and one
PostgreSQL server for the session with a fresh database per test (the store contract runs on both backends). The
server and `Backend` are bench/job_stores.py's (a bench starts them too); here they skip with the reason instead of
raising where PostgreSQL cannot be installed or started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.job_stores import Backend, PostgresServer, PostgresUnavailable, start_postgres


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


@contextmanager
def postgres_server(address: str = "", inside: list[str] | None = None) -> Iterator[PostgresServer]:
    """`start_postgres` for a test: skips with the reason when PostgreSQL or psycopg is not installed, or it does
    not start."""
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(start_postgres(address, inside))
        except PostgresUnavailable as exc:
            pytest.skip(str(exc))
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One PostgreSQL for the session (skips with the reason where it cannot be installed or started). A module
    imports it with `backend`."""
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path) -> Backend:
    """The store contract runs on each backend: a fresh SQLite file, or a fresh database on the one server."""
    if request.param == "postgresql":
        return Backend("postgresql", request.getfixturevalue("postgres").new_database())
    return Backend("sqlite", str(tmp_path / "nested" / "jobs.sqlite"))
