"""A job store no restart can fix is refused at start (issues 29, 51): a file that is not a database, one failing
`PRAGMA quick_check`, one another program keeps locked (a sqlite3 connection holding BEGIN EXCLUSIVE), and one that
is not the store the directory held (missing, truncated to 0 bytes, another directory's). The real
`h3serve serve gateway` exits EXIT_REFUSED, which no supervisor restarts, naming the file, the reason and the way out;
and the way out works."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from conftest import free_port, with_store, write_config

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.processes import EXIT_REFUSED, command_line
from h3serve.common.server import is_answering
from h3serve.gateway.jobs.sqlite import BUSY_WAIT_S
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
CLI = [sys.executable, "-m", "h3serve.cli"]
PAGE = 4096


def _deployment(tmp_path: Path) -> tuple[Path, Path, int]:
    """A gateway alone (its stages never asked): its deployment file, its store's path and its port."""
    port = free_port()
    config = write_config(
        tmp_path / "deploy.toml", "", tmp_path / "gateway", dict(encoder=1, dit=2, vae=3, gateway=port)
    )
    return config, tmp_path / "gateway" / "jobs.sqlite", port


def _serve(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "serve", "gateway", "--config", str(config)], capture_output=True, text=True, timeout=120
    )


def _store_with_jobs(path: Path, count: int = 40) -> None:
    async def submit(store):
        for i in range(count):
            await store.submit(f"job-{i}", S.ResolvedRequest(prompt=f"a fox, take {i} " * 20))

    with_store(path, submit)


def _damaged(path: Path, reason: str) -> str:
    return (
        f"refused: [gateway] job store {path} is damaged ({reason}): its jobs cannot be read. Move it aside, with its "
        f"-wal and -shm files, remove {path}.id and start the gateway again: it starts a new, empty store, and the "
        "jobs in the old one are lost (`sqlite3 <old file> .recover` may save some of them)"
    )


def test_a_file_that_is_not_a_database_is_refused_and_moving_it_aside_starts_a_new_store(tmp_path):
    config, path, port = _deployment(tmp_path)
    path.parent.mkdir()
    path.write_text("job_id,state\nabc,done\n")  # say, a CSV export written over it
    refused = _serve(config)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert _damaged(path, "file is not a database") in refused.stderr.splitlines()

    path.rename(path.with_name("jobs.sqlite.damaged"))
    with (
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",), ready=is_answering),
        GatewayClient(f"127.0.0.1:{port}") as client,
    ):
        assert list(client.stub.ListJobs(S.ListJobsRequest()).jobs) == []


def test_a_store_failing_its_quick_check_is_refused_naming_the_problem(tmp_path):
    config, path, _ = _deployment(tmp_path)
    _store_with_jobs(path)
    with open(path, "r+b") as file:  # a torn write: garbage over the cells of the jobs table's third page
        file.seek(2 * PAGE + 100)
        file.write(b"\xff" * (PAGE - 200))
    refused = _serve(config)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("refused: ")]
    head, tail = _damaged(path, "PRAGMA quick_check: \0").split("\0")
    assert line.startswith(head) and line.endswith(tail), line
    assert re.search(r"page \d+", line[len(head) : -len(tail)]), "the problem quick_check found"


def test_a_store_another_program_keeps_locked_is_refused_naming_the_holder(tmp_path):
    config, path, _ = _deployment(tmp_path)
    _store_with_jobs(path, count=1)
    with closing(sqlite3.connect(path, isolation_level=None)) as holder:  # as the sqlite3 shell after BEGIN EXCLUSIVE
        holder.execute("BEGIN EXCLUSIVE")
        refused = _serve(config)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert (
        f"refused: [gateway] job store {path} is locked by another program: its write lock stayed taken for "
        f"{BUSY_WAIT_S:g} s; the file is open in pid {os.getpid()} ({command_line(os.getpid())}). Close the program "
        "holding it (a sqlite3 shell in a transaction, a backup tool) and start the gateway again"
    ) in refused.stderr.splitlines()


# The store knows it existed (issue 51): its id is in the file and in jobs.sqlite.id beside it.


def _not_here(path: Path, what: str) -> str:
    return (
        f"refused: [gateway] job store {path} {what}, but {path}.id says this directory held store "
        f"{_mark(path)}: its jobs are not here. Put the store's file back (with its -wal and -shm files, from where it "
        f"was moved or from a backup) and start the gateway again; to start a new, empty store here instead, remove "
        f"{path}.id"
    )


def _mark(path: Path) -> str:
    return Path(f"{path}.id").read_text().strip()


def _file_id(path: Path) -> str:
    with closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT store_id FROM store").fetchone()[0]


def test_a_store_truncated_to_0_bytes_is_refused_naming_the_store_the_directory_held(tmp_path):
    config, path, _ = _deployment(tmp_path)
    _store_with_jobs(path, count=3)
    path.write_bytes(b"")
    refused = _serve(config)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert _not_here(path, "is empty (0 bytes)") in refused.stderr.splitlines()
    assert path.stat().st_size == 0, "the refusal wrote nothing into the file"


def test_a_missing_store_is_refused_and_its_file_put_back_opens_with_every_job(tmp_path):
    config, path, _ = _deployment(tmp_path)
    _store_with_jobs(path, count=3)
    aside = path.rename(path.with_name("moved.sqlite"))
    refused = _serve(config)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert _not_here(path, "is missing") in refused.stderr.splitlines()
    assert not path.exists(), "the refusal created no file"

    aside.rename(path)

    async def count(store):
        assert len((await store.list_jobs([], limit=10))[0]) == 3

    with_store(path, count)


def test_another_directorys_store_is_refused_naming_both_ids(tmp_path):
    config, path, _ = _deployment(tmp_path)
    _store_with_jobs(path, count=1)
    other = tmp_path / "other" / "jobs.sqlite"
    _store_with_jobs(other, count=1)
    expected, foreign = _mark(path), _file_id(other)
    other.replace(path)
    refused = _serve(config)
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert (
        f"refused: [gateway] job store {path} is store {foreign}, not store {expected} that {path}.id says this "
        "directory held: it is another directory's store, or an old copy. Put this directory's own store back and "
        f"start the gateway again; to keep this one instead, remove {path}.id (this store's id is then taken as this "
        "directory's)"
    ) in refused.stderr.splitlines()


def test_a_new_directory_starts_a_new_store_and_says_so(tmp_path, caplog):
    path = tmp_path / "fresh" / "jobs.sqlite"
    caplog.set_level("INFO", logger="h3serve.gateway.jobs")
    with_store(path, lambda store: asyncio.sleep(0))
    store_id = _file_id(path)
    assert _mark(path) == store_id and len(store_id) == 32
    assert f"job store {path}: a new, empty store {store_id} (no store was in {path.parent} before)" in caplog.messages

    caplog.clear()
    with_store(path, lambda store: asyncio.sleep(0))  # the same store again: nothing to say, nothing rewritten
    assert caplog.messages == [] and _mark(path) == store_id


def test_a_file_from_before_the_id_is_taken_as_the_directorys_store(tmp_path, caplog):
    path = tmp_path / "jobs.sqlite"
    with closing(sqlite3.connect(path)) as old:  # a store written before the id existed: its jobs table, no mark
        old.execute(
            "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, state INTEGER NOT NULL, request BLOB NOT NULL, "
            "created REAL NOT NULL, updated REAL NOT NULL, error BLOB, last_seq INTEGER NOT NULL DEFAULT 0)"
        )
        old.execute("INSERT INTO jobs VALUES ('old', 1, x'', 0, 0, NULL, 0)")
        old.commit()
    caplog.set_level("INFO", logger="h3serve.gateway.jobs")

    async def read(store):
        assert (await store.get_job("old")).job_id == "old"

    with_store(path, read)
    store_id = _file_id(path)
    assert _mark(path) == store_id
    assert f"job store {path}: store {store_id} taken as this directory's ({path}.id written)" in caplog.messages
