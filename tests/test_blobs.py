"""Blobs in a shared directory (h3serve/gateway/blobs.py): keys never leave it; a store from before keys (local paths
in its artifacts' rows) is migrated to keys on both backends; and gateways sharing a PostgreSQL store take turns at
retention, so each expired artifact is removed once."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest
import stores

from h3serve.gateway.blobs import DirectoryBlobs, chunks_of
from h3serve.gateway.jobs.artifacts import KEYS_FROM_PATHS, ArtifactStore
from h3serve.gateway.jobs.retention import Retention
from h3serve.v1 import gateway_pb2

S = gateway_pb2
REQUEST = S.ResolvedRequest(prompt="x")
postgres = stores.postgres  # fixture


def test_a_blob_is_written_whole_and_read_back_by_its_key(tmp_path):
    blobs = DirectoryBlobs(str(tmp_path))
    source = tmp_path / "source"
    source.write_bytes(b"a\nb\n" * 300_000)  # newlines: chunks_of reads by size, never by line
    with open(source, "rb") as file:
        digest, size = blobs.put("assets/blobs/x", chunks_of(file, 4096))
    assert size == source.stat().st_size and blobs.size("assets/blobs/x") == size
    with blobs.open("assets/blobs/x") as file:
        assert file.read() == source.read_bytes()
    assert blobs.keys("assets/blobs/") == ["assets/blobs/x"] and blobs.keys("nothing/") == []
    assert len(digest) == 64 and blobs.exists("assets/blobs/x")
    blobs.delete("assets/blobs/x")
    blobs.delete("assets/blobs/x")  # already gone: no error
    assert not blobs.exists("assets/blobs/x")


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../outside", "artifacts/../../outside", "a//b", "./a"])
def test_a_key_never_names_a_file_outside_the_blob_directory(tmp_path, key):
    blobs = DirectoryBlobs(str(tmp_path / "blobs"))
    with pytest.raises(ValueError, match="a blob key is a relative name inside the blob directory"):
        blobs.put(key, b"x")
    assert not blobs.exists(key), "a key no blob can have is no blob (not an error)"
    assert list((tmp_path / "blobs").iterdir()) == []


def _old_file(data_dir: Path) -> str:
    """An artifact file as a gateway from before blob keys left it: under data_dir/artifacts, its path recorded."""
    path = data_dir / "artifacts" / "h3-old.mp4"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"an old clip")
    return str(path)


async def _artifact_row(store, key: str) -> None:
    await store.submit("old", REQUEST)
    artifact = S.Artifact(artifact_id="old-video", file_name="h3-old.mp4", bytes=11, sha256="ab" * 32)
    await store.add_artifact("old", "video", artifact, key)


async def _served(store, blobs: DirectoryBlobs) -> bytes:
    found = await store.artifact("old-video")
    assert found is not None and found[1] == "artifacts/h3-old.mp4", found
    artifacts = ArtifactStore(blobs)
    assert artifacts.exists(found[1])
    with artifacts.open(found[1]) as file:
        return file.read()


def test_an_old_sqlite_stores_paths_become_keys_and_its_artifacts_are_served(tmp_path):
    data_dir = tmp_path / "gateway"
    old_path = _old_file(data_dir)
    db = data_dir / "jobs.sqlite"
    stores.with_store(db, lambda store: _artifact_row(store, "unused"))
    with closing(sqlite3.connect(db)) as conn, conn:  # the file as the release before keys left it
        conn.execute("ALTER TABLE artifacts RENAME COLUMN blob_key TO path")
        conn.execute("UPDATE artifacts SET path = ?", (old_path,))

    async def reopened(store):
        assert await _served(store, DirectoryBlobs(str(data_dir))) == b"an old clip"

    stores.with_store(db, reopened)
    stores.with_store(db, reopened)  # the migration ran once: a second open finds keys and keeps them


def test_an_old_postgresql_stores_paths_become_keys_and_its_artifacts_are_served(postgres, tmp_path):
    from h3serve.gateway.jobs.postgres.schema import MIGRATIONS

    data_dir = tmp_path / "gateway"
    old_path = _old_file(data_dir)
    backend = stores.Backend("postgresql", postgres.new_database())
    backend.run(lambda store: _artifact_row(store, "unused"))
    downgrade(backend.location, old_path)
    assert backend.run(lambda store: _served(store, DirectoryBlobs(str(data_dir)))) == b"an old clip"
    assert _version(backend.location) == len(MIGRATIONS)
    assert backend.run(lambda store: _served(store, DirectoryBlobs(str(data_dir)))) == b"an old clip", "once"


def downgrade(url: str, old_path: str) -> None:
    """Make a PostgreSQL store look as the release before blob keys left it: every artifact's local path recorded,
    its schema at the step before the keys'."""
    import psycopg

    from h3serve.gateway.jobs.postgres.schema import MIGRATIONS

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE artifacts RENAME COLUMN blob_key TO path")
        conn.execute("UPDATE artifacts SET path = %s", (old_path,))
        conn.execute("UPDATE schema_version SET version = %s", (MIGRATIONS.index("; ".join(KEYS_FROM_PATHS)),))


def _version(url: str) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute("SELECT version FROM schema_version").fetchone()[0]


def test_two_gateways_retention_passes_at_once_remove_each_expired_artifact_once(postgres, tmp_path):
    """Two stores on one database are two gateways: while one holds the retention turn the other skips its pass,
    and two passes started together remove each artifact once between them."""
    from h3serve.gateway.jobs.postgres import PostgresJobStore

    url = postgres.new_database()
    blobs = DirectoryBlobs(str(tmp_path / "shared"))
    artifacts = ArtifactStore(blobs)

    async def scenario():
        a, b = await PostgresJobStore.open(url), await PostgresJobStore.open(url)
        try:
            keys = {}
            for n in range(6):
                job_id = f"j{n}"
                await a.submit(job_id, REQUEST)
                artifact, keys[artifact.artifact_id] = artifacts.save(job_id, "video", b"clip %d" % n)
                await a.add_artifact(job_id, "video", artifact, keys[artifact.artifact_id])
            later = time.time() + 60

            async with a.retention_turn() as ours:
                assert ours
                assert await Retention(b, artifacts, max_age_s=1.0).enforce(later) == [], "not b's turn: skipped"
                async with b.retention_turn() as theirs:
                    assert not theirs
            assert all(blobs.exists(key) for key in keys.values()), "a skipped pass removes nothing"

            passes = [Retention(store, artifacts, max_age_s=1.0).enforce(later) for store in (a, b)]
            removed = [artifact_id for each in await asyncio.gather(*passes) for artifact_id in each]
            assert sorted(removed) == sorted(keys), "each expired artifact removed once, by one of the two"
            assert await a.artifacts_oldest_first() == [] and blobs.keys("artifacts/") == []
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())
