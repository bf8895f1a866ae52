"""Content-addressed asset storage: an asset's id is the sha256 of its bytes, so the same file is stored once.

Assets are blobs (h3serve/gateway/blobs.py), so that an upload to one gateway serves a job submitted to another:
`assets/blobs/<id>` (the original bytes) and `assets/meta/<id>.pb` (its `Asset` description). An upload is spooled
to a directory of this gateway's own (`<data_dir>/assets/tmp/`) while it is checked and decoded; each blob is
written whole under a temporary name and renamed into place, so a reader never sees half an asset; the description
is written last, and an asset exists once it has one. An upload that meets a full disk leaves nothing behind and raises
DiskFull naming the directory it filled.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from collections.abc import AsyncIterator, Iterable

from h3serve.common.disk import full_named
from h3serve.gateway.assets.validate import (
    SNIFF_BYTES,
    AssetLimits,
    candidate_kinds,
    inspect,
    invalid,
    over_limit,
    sniff,
)
from h3serve.gateway.blobs import Blobs, chunks_of
from h3serve.v1 import gateway_pb2

_ID = re.compile(r"[0-9a-f]{64}")
CONTENT, META = "assets/blobs/", "assets/meta/"  # the keys' prefixes: an asset's bytes and its description


class AssetStore:
    def __init__(self, blobs: Blobs, scratch: str, limits: AssetLimits) -> None:
        """`scratch`: a directory of this gateway's own; uploads are spooled in its `tmp/`."""
        self.blobs, self.scratch, self.limits = blobs, scratch, limits
        os.makedirs(os.path.join(scratch, "tmp"), exist_ok=True)

    def get(self, asset_id: str) -> gateway_pb2.Asset | None:
        if not _ID.fullmatch(asset_id):  # also keeps ids from naming other keys
            return None
        try:
            with self.blobs.open(meta_key(asset_id)) as file:
                return gateway_pb2.Asset.FromString(file.read())
        except FileNotFoundError:
            return None

    async def read(self, asset_id: str, chunk_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        """The asset's bytes, chunk by chunk, read off the event loop."""
        file = await asyncio.to_thread(self.blobs.open, CONTENT + asset_id)
        try:
            while data := await asyncio.to_thread(file.read, chunk_bytes):
                yield data
        finally:
            file.close()

    def remove_older_than(self, cutoff: float, keep: set[str]) -> list[str]:
        """Delete the assets stored before `cutoff` (unix seconds) but those in `keep`; returns their ids."""
        removed = []
        for meta in self.blobs.keys(META):
            asset_id = meta.removeprefix(META).removesuffix(".pb")
            if asset_id in keep or not _ID.fullmatch(asset_id) or not self._stored_before(meta, cutoff):
                continue
            self.blobs.delete(meta)  # first: without its description the asset no longer exists
            self.blobs.delete(CONTENT + asset_id)
            removed.append(asset_id)
        return removed

    def _stored_before(self, key: str, cutoff: float) -> bool:
        try:
            return self.blobs.modified(key) < cutoff
        except FileNotFoundError:  # another pass removed it meanwhile
            return False

    async def find(self, asset_ids: Iterable[str]) -> dict[str, gateway_pb2.Asset]:
        """The stored descriptions of `asset_ids` (unknown ids left out), read off the event loop."""
        found = await asyncio.to_thread(lambda: {asset_id: self.get(asset_id) for asset_id in set(asset_ids)})
        return {asset_id: asset for asset_id, asset in found.items() if asset is not None}

    async def upload(self, chunks: AsyncIterator[gateway_pb2.UploadAssetChunk]) -> gateway_pb2.Asset:
        """Spool an upload (refusing it as soon as it passes its format's byte limit), validate it, store it once.
        The disk work and the decode run off the event loop."""
        with full_named(self.scratch):
            fd, tmp = await asyncio.to_thread(tempfile.mkstemp, dir=os.path.join(self.scratch, "tmp"))
            try:
                with os.fdopen(fd, "wb") as file:
                    name, fmt, size, digest = await self._spool(chunks, file)
                return await asyncio.to_thread(self._keep, tmp, name, fmt, size, digest)
            finally:
                await asyncio.to_thread(_remove_if_present, tmp)

    def _keep(self, tmp: str, name: str, fmt: str, size: int, digest: str) -> gateway_pb2.Asset:
        """The spooled file `tmp` as a stored asset: decoded and described, unless the same bytes are stored."""
        existing = self.get(digest)
        if existing is not None:  # named as this upload names it: the first upload may be another client's
            existing.deduplicated, existing.file_name = True, name
            return existing
        asset = inspect(tmp, name, fmt, size, self.limits)
        asset.asset_id, asset.file_name = digest, name
        with open(tmp, "rb") as spooled:
            self.blobs.put(CONTENT + digest, chunks_of(spooled))
        try:
            self.blobs.put(meta_key(digest), asset.SerializeToString())
        except Exception:  # without its description the blob is no asset, and nothing would ever remove it
            self.blobs.delete(CONTENT + digest)
            raise
        return asset

    async def _spool(self, chunks, file) -> tuple[str, str, int, str]:
        name, fmt, size, head = "", None, 0, b""
        digest, limit = hashlib.sha256(), None
        async for chunk in chunks:
            name = name or chunk.file_name
            if fmt is None:
                head += chunk.data[: SNIFF_BYTES - len(head)]
                if len(head) >= SNIFF_BYTES:
                    fmt, limit = self._format(name or "upload", head)
            size += len(chunk.data)
            if limit and size > limit[0]:
                raise over_limit(name or "upload", "size", f"more than {limit[0]} bytes", f"{limit[0]} bytes", limit[1])
            digest.update(chunk.data)
            await asyncio.to_thread(file.write, chunk.data)
        name = name or "upload"
        if not size:
            raise invalid(name, "empty file (0 bytes)")
        if fmt is None:
            fmt, _ = self._format(name, head)
        return name, fmt, size, digest.hexdigest()

    def _format(self, name: str, head: bytes):
        fmt = sniff(head)
        if fmt is None:
            raise invalid(
                name,
                "not a supported image (PNG, JPEG, WebP), video (MP4, MOV, WebM) or audio "
                "(WAV, FLAC, MP3, AAC/M4A, OGG) file: its content starts with "
                f"{head[:8]!r}",
            )
        return fmt, self.limits.max_bytes(candidate_kinds(fmt))


def meta_key(asset_id: str) -> str:
    return f"{META}{asset_id}.pb"


def _remove_if_present(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
