"""A job's artifacts as blobs (h3serve/gateway/blobs.py) under `artifacts/`, named by the job, so that any gateway
sharing the blob directory serves them. Written atomically: a crash never leaves a truncated blob under a final name.

A write that meets a full disk removes its partial file and raises DiskFull naming the artifacts' directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

from h3serve.gateway.blobs import Blobs, BytesLike
from h3serve.v1 import gateway_pb2

# kind -> (file extension, media type)
KINDS = {"video": (".mp4", "video/mp4"), "raw": (".npz", "application/x-npz")}

PREFIX = "artifacts/"  # the artifacts' keys

# A store from before blob keys recorded each artifact's local path, always `<data_dir>/artifacts/<file_name>`: its
# key is then `artifacts/<file_name>`, the same file under the default blob_dir (data_dir). Both backends' migrations
# run these once, while the column is still `path`: keys first, so that a stop between the two leaves a column that
# is migrated again, harmlessly.
KEYS_FROM_PATHS = (
    f"UPDATE artifacts SET path = '{PREFIX}' || file_name",
    "ALTER TABLE artifacts RENAME COLUMN path TO blob_key",
)


class ArtifactStore:
    def __init__(self, blobs: Blobs):
        self.blobs = blobs

    @property
    def disk(self) -> str:
        """A directory on the artifacts' disk (what a wait for space names)."""
        return self.blobs.disk(PREFIX)

    def save(self, job_id: str, kind: str, data: BytesLike | Iterable[BytesLike]) -> tuple[gateway_pb2.Artifact, str]:
        """Write `data` (bytes or an iterable of byte chunks) as the job's `kind` artifact; returns it and its key."""
        if kind not in KINDS:
            raise ValueError(f"artifact kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if "/" in job_id or "\\" in job_id:
            raise ValueError(f"job id must not contain a path separator, got {job_id!r}")
        extension, media_type = KINDS[kind]
        file_name = f"h3-{job_id}{extension}"
        key = PREFIX + file_name
        digest, size = self.blobs.put(key, data)
        artifact = gateway_pb2.Artifact(
            artifact_id=f"{job_id}-{kind}", file_name=file_name, bytes=size, sha256=digest, media_type=media_type
        )
        return artifact, key

    def exists(self, key: str) -> bool:
        return self.blobs.exists(key)

    def open(self, key: str) -> BinaryIO:
        return self.blobs.open(key)

    def remove(self, key: str) -> None:
        """Delete an artifact's blob; one already gone is no error."""
        self.blobs.delete(key)
