"""Artifact retention: files older than the age limit go, then the oldest until the byte cap holds.

A removed artifact disappears from the store too, so GetJob never lists a file that is gone and
DownloadArtifact answers NOT_FOUND for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from h3serve.gateway.jobs.store import JobStore

log = logging.getLogger("h3serve.gateway.retention")


@dataclass(frozen=True)
class Retention:
    store: JobStore
    max_age_s: float = 0.0    # 0: no age limit
    max_bytes: int = 0        # 0: no byte cap

    async def enforce(self, now: float | None = None) -> list[str]:
        """Delete what the policy no longer keeps; returns the removed artifact ids."""
        if self.max_age_s <= 0 and self.max_bytes <= 0:
            return []
        now = time.time() if now is None else now
        artifacts = await self.store.artifacts_oldest_first()
        total = sum(artifact.bytes for artifact in artifacts)
        removed = []
        for artifact in artifacts:
            too_old = self.max_age_s > 0 and now - artifact.created > self.max_age_s
            over_cap = self.max_bytes > 0 and total > self.max_bytes
            if not (too_old or over_cap):
                continue
            await self.store.delete_artifact(artifact.artifact_id)
            await asyncio.to_thread(_unlink, artifact.path)
            total -= artifact.bytes
            removed.append(artifact.artifact_id)
        if removed:
            log.info("retention removed %d artifact(s): %s", len(removed), ", ".join(removed))
        return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
