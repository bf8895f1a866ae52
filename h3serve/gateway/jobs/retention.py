"""Retention: artifacts older than the age limit go, then the oldest until the byte cap holds; uploaded assets
older than theirs go unless a queued or running job names them.

A removed artifact disappears from the store too, so GetJob never lists a file that is gone and
DownloadArtifact answers NOT_FOUND for it; a removed asset is an unknown asset_id to the next request.
On a full disk, when the store cannot record a removal, the file goes first to make the room; a pass the disk
stops is logged and the next one carries on. Gateways sharing a store and a blob directory take turns: a pass runs
only on the gateway that has the store's retention turn (PostgreSQL: an advisory lock), the others skip it, so each
expired artifact is removed once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from h3serve.common.disk import DiskFull
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.store import JobStore, StoredArtifact, StoreUnavailable
from h3serve.model import workflows

log = logging.getLogger("h3serve.gateway.retention")


@dataclass(frozen=True)
class Retention:
    store: JobStore
    artifacts: ArtifactStore
    max_age_s: float = 0.0  # artifacts; 0: no age limit
    max_bytes: int = 0  # artifacts; 0: no byte cap
    assets: AssetStore | None = None
    asset_max_age_s: float = 0.0  # 0: keep uploads

    async def enforce(self, now: float | None = None) -> list[str]:
        """Delete what the policy no longer keeps; returns the removed artifact and asset ids (none when another
        gateway's pass is under way: it does this one's work)."""
        now = time.time() if now is None else now
        try:
            async with self.store.retention_turn() as ours:
                removed = await self._artifacts(now) + await self._assets(now) if ours else []
        except (DiskFull, StoreUnavailable) as exc:
            log.warning("retention stopped until its next pass: %s", exc)
            return []
        if removed:
            log.info("retention removed %d file(s): %s", len(removed), ", ".join(removed))
        return removed

    async def _assets(self, now: float) -> list[str]:
        if self.assets is None or self.asset_max_age_s <= 0:
            return []
        in_use = {asset_id for job in await self.store.unfinished() for asset_id in workflows.asset_ids(job.request)}
        return await asyncio.to_thread(self.assets.remove_older_than, now - self.asset_max_age_s, in_use)

    async def _artifacts(self, now: float) -> list[str]:
        if self.max_age_s <= 0 and self.max_bytes <= 0:
            return []
        artifacts = await self.store.artifacts_oldest_first()
        total = sum(artifact.bytes for artifact in artifacts)
        removed = []
        for artifact in artifacts:
            too_old = self.max_age_s > 0 and now - artifact.created > self.max_age_s
            over_cap = self.max_bytes > 0 and total > self.max_bytes
            if not (too_old or over_cap):
                continue
            await self._remove(artifact)
            total -= artifact.bytes
            removed.append(artifact.artifact_id)
        return removed

    async def _remove(self, artifact: StoredArtifact) -> None:
        """The record first, so that no job lists a file that is gone; on a full disk the record cannot go before
        the file has made room for its deletion."""
        try:
            await self.store.delete_artifact(artifact.artifact_id)
        except DiskFull:
            await asyncio.to_thread(self.artifacts.remove, artifact.key)
            await self.store.delete_artifact(artifact.artifact_id)
        await asyncio.to_thread(self.artifacts.remove, artifact.key)
