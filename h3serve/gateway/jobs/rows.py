"""How a job store's rows read back as messages, the same for every backend (sqlite/, postgres/).

The column lists below are the order both backends select in, so one decoder serves both; the stored forms
(a request and an error as serialized protobuf, times as seconds since the epoch) are the same in each.
"""

from __future__ import annotations

from h3serve.common.errors import tail
from h3serve.gateway.tenants.clients import DEFAULT as DEFAULT_OWNER
from h3serve.v1 import gateway_pb2

__all__ = ["DEFAULT_OWNER"]

JOB_FIELDS = (
    "job_id, state, request, created, updated, error, last_seq, request_id, attempts, deleted, progress, owner, "
    "webhook_url"
)
# A new job's row, the same in both backends; `placeholder` is the driver's parameter mark (? or %s).
NEW_JOB_FIELDS = "job_id, state, request, created, updated, request_id, request_digest, progress, owner, webhook_url"


def insert_new_job(placeholder: str) -> str:
    marks = ", ".join(placeholder if name != "progress" else "0" for name in NEW_JOB_FIELDS.split(", "))
    return f"INSERT INTO jobs ({NEW_JOB_FIELDS}) VALUES ({marks})"


def new_job_values(job_id: str, request, now: float, request_id: str, digest: str, owner) -> tuple:
    """The parameters of `insert_new_job`: a queued job, its progress 0."""
    state = gateway_pb2.JOB_STATE_QUEUED
    serialized = request.SerializeToString()
    return (job_id, state, serialized, now, now, request_id or None, digest or None, owner.client, owner.webhook_url)


OUTBOX_FIELDS = "event_id, type, attempts, last_status, last_error, delivered_at, next_at"
ARTIFACT_FIELDS = "artifact_id, file_name, bytes, sha256, media_type"
RECORD_COLUMNS = ("enqueued", "started", "finished", "replica", "bytes_in", "bytes_out", "tries", "error")


def job_from_row(row) -> gateway_pb2.Job:
    job_id, state, request, created, updated, error, last_seq, request_id, attempts, deleted, done, owner, url = row
    job = gateway_pb2.Job(
        job_id=job_id,
        state=state,
        request=stored_request(request),
        created=created,
        updated=updated,
        last_event_seq=last_seq,
        request_id=request_id or "",
        attempts=attempts,
        deleted=deleted,
        progress=done,
        client=owner,
    )
    if error is not None:
        job.error.ParseFromString(error)
    if url:
        job.webhook.url = url
    return job


def delivery_from_row(delivery: gateway_pb2.WebhookDelivery, row) -> None:
    """The outbox row's state (OUTBOX_FIELDS) on the job's webhook."""
    (
        delivery.event_id,
        delivery.event_type,
        delivery.attempts,
        delivery.last_status,
        delivery.last_error,
        delivery.delivered_at,
        delivery.next_attempt_at,
    ) = row


def artifact_from_row(row) -> gateway_pb2.Artifact:
    artifact_id, file_name, size, sha256, media_type = row
    return gateway_pb2.Artifact(
        artifact_id=artifact_id, file_name=file_name, bytes=size, sha256=sha256, media_type=media_type
    )


def stored_request(blob: bytes) -> gateway_pb2.ResolvedRequest:
    """A stored request; one stored before GenerationParams existed takes them from its top-level copies."""
    request = gateway_pb2.ResolvedRequest.FromString(blob)
    if not request.HasField("params"):
        request.params.num_inference_steps, request.params.include_raw = (
            request.num_inference_steps,
            request.include_raw,
        )
        request.params.seed = request.seed
    return request


def kept_end(failed: gateway_pb2.Failed) -> gateway_pb2.Failed:
    """A copy whose message is cut from the front: the cause of an error is at its end."""
    trimmed = gateway_pb2.Failed()
    trimmed.CopyFrom(failed)
    trimmed.message = tail(failed.message)
    return trimmed
