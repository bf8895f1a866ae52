"""Job stores by location, on either backend, and a PostgreSQL server of one's own for a bench or a test.

PostgreSQL comes from the OS packages (`make test` installs them where apt-get can); `initdb` refuses root, so
under root the server runs as the `postgres` user through runuser. Where it cannot be installed or started,
`start_postgres` raises PostgresUnavailable with the reason (tests/stores.py's `postgres_server` skips on it).
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


class PostgresUnavailable(Exception):
    """PostgreSQL is not installed here, or did not start (the reason)."""


class PostgresServer:
    """A running PostgreSQL on a socket directory of its own (and, when started with `address`, on that TCP address);
    `new_database()` is a fresh, empty database's URL. `stop()` and `start()` take it away and bring it back (same
    data, same socket): a store's outage."""

    def __init__(self, socket_dir: str, port: int, pg_ctl: list[str], address: str = ""):
        self.socket_dir, self.port, self.address = socket_dir, port, address
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

    def tcp_url(self, database: str) -> str:
        """The URL of `database` over TCP, as a client on another host reaches it (`address` must be set)."""
        assert self.address, "started without a TCP address"
        return f"postgresql://h3@{self.address}:{self.port}/{database}"

    def new_database(self) -> str:
        return self.url(self.create_database())

    def create_database(self) -> str:
        """A fresh, empty database; returns its name."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return name


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
def start_postgres(address: str = "", inside: list[str] | None = None) -> Iterator[PostgresServer]:
    """Start PostgreSQL (as `postgres` under root), listening on a socket in a temporary directory and, with
    `address`, on that TCP address too, open to any client there (trust: a test server); `inside` prefixes its
    commands (`ip netns exec NAME`: the server runs in that network namespace). Stopped, its files removed,
    afterwards. Raises PostgresUnavailable with the reason where it is not installed or does not start."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        raise PostgresUnavailable("PostgreSQL is not installed (no initdb; `make test` installs it where apt-get can)")
    as_user = [*(inside or []), *(["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else [])]
    home = tempfile.mkdtemp(prefix="h3serve-pg-")
    data = os.path.join(home, "data")
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
    port = _free_port()
    options = f"-p {port} -k {home} -c listen_addresses='{address}' -c fsync=off -c full_page_writes=off"
    pg_ctl = [*as_user, f"{bin_dir}/pg_ctl", "-D", data, "-o", options, "-l", f"{home}/log"]
    run = {"check": True, "capture_output": True, "text": True}
    try:
        subprocess.run([*as_user, f"{bin_dir}/initdb", "-D", data, "-A", "trust", "-U", "h3", "--no-sync"], **run)
        if address:
            subprocess.run([*as_user, "sh", "-c", f"echo 'host all all 0.0.0.0/0 trust' >> {data}/pg_hba.conf"], **run)
        subprocess.run([*pg_ctl, "-w", "start"], **run)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(home, ignore_errors=True)
        raise PostgresUnavailable(f"PostgreSQL did not start: {exc.stderr.strip() or exc.stdout.strip()}") from exc
    try:
        yield PostgresServer(home, port, pg_ctl, address)
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
