"""The event a job's end sends: OpenAI's video webhook, `{"id", "object": "event", "created_at", "type", "data"}`.

`video.completed` for a job that SUCCEEDED, `video.failed` for one that FAILED; a cancelled job sends none (OpenAI's
video API has no such event, and its client asked for the cancel). `data.id` is the job id, the video's id on the
HTTP door.
"""

from __future__ import annotations

import json
import secrets

from h3serve.v1 import gateway_pb2

TYPES: dict[int, str] = {
    gateway_pb2.JOB_STATE_SUCCEEDED: "video.completed",
    gateway_pb2.JOB_STATE_FAILED: "video.failed",
}


def new_id() -> str:
    return "evt_" + secrets.token_hex(16)


def body(event_id: str, event_type: str, job_id: str, created_at: float) -> bytes:
    """The bytes sent (and signed) on every attempt."""
    event = {
        "id": event_id,
        "object": "event",
        "created_at": int(created_at),
        "type": event_type,
        "data": {"id": job_id},
    }
    return json.dumps(event, separators=(",", ":")).encode()
