"""Job stores for tests: a SQLite store opened for one scenario (for tests that read or damage its file), and one
PostgreSQL server for the session with a fresh database per test (the store contract runs on both backends).

PostgreSQL comes from the OS packages (`make test` installs them where apt-get can); `initdb` refuses root, so
under root the server runs as the `postgres` user through runuser. Where it cannot be installed or started,
`postgres_server` skips with the reason.
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


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


class Backend:
    """One store's location on one backend ("sqlite": a file; "postgresql": a database URL); `open` opens it
    (again: a reopen sees what an earlier store wrote), `run(scenario)` runs `await scenario(store)` on it."""

    def __init__(self, name: str, location: str):
        self.name, self.location = name, location

    def __repr__(self) -> str:
        return self.name

    async def open(self):
        if self.name == "postgresql":
            from h3serve.gateway.jobs.postgres import PostgresJobStore

            return await PostgresJobStore.open(self.location)
        from h3serve.gateway.jobs.sqlite import SqliteJobStore

        return SqliteJobStore(self.location)

    def run(self, scenario):
        async def go():
            store = await self.open()
            try:
                return await scenario(store)
            finally:
                await store.close()

        return asyncio.run(go())


class PostgresServer:
    """A running PostgreSQL on a socket directory of its own; `new_database()` is a fresh, empty database's URL.
    `stop()` and `start()` take it away and bring it back (same data, same socket): a store's outage."""

    def __init__(self, socket_dir: str, port: int, pg_ctl: list[str]):
        self.socket_dir, self.port = socket_dir, port
        self._pg_ctl = pg_ctl  # pg_ctl with its data directory, as the server's user
        self._names = itertools.count()

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`fast`: its sessions are cut off, as in a restart), waiting until it is down."""
        subprocess.run([*self._pg_ctl, "-m", mode, "-w", "stop"], check=True, capture_output=True)

    def start(self) -> None:
        """Start it again with its settings, waiting until it takes connections."""
        subprocess.run([*self._pg_ctl, "-w", "start"], check=True, capture_output=True)

    def url(self, database: str) -> str:
        return f"postgresql://h3@/{database}?host={self.socket_dir}&port={self.port}"

    def new_database(self) -> str:
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _postgres_bin() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start PostgreSQL (as `postgres` under root), listening only on a socket in a temporary directory; stop it
    and remove its files afterwards. Skips when PostgreSQL or psycopg is not installed."""
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb; `make test` installs it where apt-get can)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    home = tempfile.mkdtemp(prefix="h3serve-pg-")
    data = os.path.join(home, "data")
    if as_user:
        shutil.chown(home, "postgres")
    port = _free_port()
    options = f"-p {port} -k {home} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
    pg_ctl = [*as_user, f"{bin_dir}/pg_ctl", "-D", data, "-o", options, "-l", f"{home}/log"]
    run = {"check": True, "capture_output": True, "text": True}
    try:
        subprocess.run([*as_user, f"{bin_dir}/initdb", "-D", data, "-A", "trust", "-U", "h3", "--no-sync"], **run)
        subprocess.run([*pg_ctl, "-w", "start"], **run)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(home, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {exc.stderr.strip() or exc.stdout.strip()}")
    try:
        yield PostgresServer(home, port, pg_ctl)
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


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
