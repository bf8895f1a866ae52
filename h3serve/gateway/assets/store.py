"""Content-addressed asset storage: an asset's id is the sha256 of its bytes, so the same file is stored once.

Layout under the root: `blobs/<id>` (the original bytes), `meta/<id>.pb` (its `Asset` description),
`tmp/` (uploads in progress). Both files are written to a temporary name and renamed into place, so a
reader never sees half an asset; the description is written last, and an asset exists once it has one. An upload
that meets a full disk leaves nothing behind and raises DiskFull naming the store's root.
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
from h3serve.v1 import gateway_pb2

_ID = re.compile(r"[0-9a-f]{64}")


class AssetStore:
    def __init__(self, root: str, limits: AssetLimits) -> None:
        self.root, self.limits = root, limits
        for sub in ("blobs", "meta", "tmp"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)

    def _path(self, sub: str, asset_id: str) -> str:
        return os.path.join(self.root, sub, asset_id + (".pb" if sub == "meta" else ""))

    def get(self, asset_id: str) -> gateway_pb2.Asset | None:
        if not _ID.fullmatch(asset_id):  # also keeps ids from naming paths
            return None
        try:
            with open(self._path("meta", asset_id), "rb") as file:
                return gateway_pb2.Asset.FromString(file.read())
        except FileNotFoundError:
            return None

    async def read(self, asset_id: str, chunk_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
        """The asset's bytes, chunk by chunk, read off the event loop."""
        file = await asyncio.to_thread(open, self._path("blobs", asset_id), "rb")
        try:
            while data := await asyncio.to_thread(file.read, chunk_bytes):
                yield data
        finally:
            file.close()

    def remove_older_than(self, cutoff: float, keep: set[str]) -> list[str]:
        """Delete the assets stored before `cutoff` (unix seconds) but those in `keep`; returns their ids."""
        removed = []
        for name in os.listdir(os.path.join(self.root, "meta")):
            asset_id = name.removesuffix(".pb")
            meta = self._path("meta", asset_id)
            if asset_id in keep or not _ID.fullmatch(asset_id) or os.path.getmtime(meta) >= cutoff:
                continue
            os.remove(meta)  # first: without its description the asset no longer exists
            _remove_if_present(self._path("blobs", asset_id))
            removed.append(asset_id)
        return removed

    async def find(self, asset_ids: Iterable[str]) -> dict[str, gateway_pb2.Asset]:
        """The stored descriptions of `asset_ids` (unknown ids left out), read off the event loop."""
        found = await asyncio.to_thread(lambda: {asset_id: self.get(asset_id) for asset_id in set(asset_ids)})
        return {asset_id: asset for asset_id, asset in found.items() if asset is not None}

    async def upload(self, chunks: AsyncIterator[gateway_pb2.UploadAssetChunk]) -> gateway_pb2.Asset:
        """Spool an upload (refusing it as soon as it passes its format's byte limit), validate it, store it once.
        The disk work and the decode run off the event loop."""
        with full_named(self.root):
            fd, tmp = await asyncio.to_thread(tempfile.mkstemp, dir=os.path.join(self.root, "tmp"))
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
        blob = self._path("blobs", digest)
        os.replace(tmp, blob)
        try:
            self._write_meta(asset)
        except OSError:  # without its description the blob is no asset, and nothing would ever remove it
            os.remove(blob)
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

    def _write_meta(self, asset: gateway_pb2.Asset) -> None:
        fd, tmp = tempfile.mkstemp(dir=os.path.join(self.root, "tmp"))
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(asset.SerializeToString())
            os.replace(tmp, self._path("meta", asset.asset_id))
        finally:
            _remove_if_present(tmp)


def _remove_if_present(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
