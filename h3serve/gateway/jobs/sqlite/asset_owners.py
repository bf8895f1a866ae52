"""Uploads' owners on SQLite: an asset is stored once per content, and each client that uploaded it owns it
(docs/tenants.md). Functions on the store's connection, called by database.py."""

from __future__ import annotations

import sqlite3
from contextlib import closing

from h3serve.gateway.jobs.rows import DEFAULT_OWNER


def own(conn: sqlite3.Connection, asset_id: str, client: str) -> bool:
    """Record that `client` uploaded the asset; whether it had not before."""
    with closing(conn.execute("INSERT OR IGNORE INTO asset_owners VALUES (?, ?)", (asset_id, client))) as cursor:
        return cursor.rowcount == 1


def owned(conn: sqlite3.Connection, asset_ids: list[str], client: str) -> set[str]:
    """Those of `asset_ids` that `client` uploaded (the default client also owns the assets nobody owns)."""
    if not asset_ids:
        return set()
    marks = ", ".join("?" * len(asset_ids))
    owners: dict[str, set[str]] = {asset_id: set() for asset_id in asset_ids}
    with closing(
        conn.execute(f"SELECT asset_id, owner FROM asset_owners WHERE asset_id IN ({marks})", tuple(asset_ids))
    ) as cursor:
        for asset_id, owner in cursor.fetchall():
            owners[asset_id].add(owner)
    return {a for a, who in owners.items() if client in who or (client == DEFAULT_OWNER and not who)}
