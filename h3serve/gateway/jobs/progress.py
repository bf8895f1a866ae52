"""A job's progress, 0..1, from its events: the formula documented on Job.progress (gateway.proto).

Pure functions of the event stream, so the store (which keeps the running value in a column) and an
event stream consumer (the HTTP door's Server-Sent Events) compute the same number event by event.
"""

from __future__ import annotations

from collections.abc import Iterable

from h3serve.v1 import gateway_pb2

# A working stage's share of the bar: (start, width, the field counting its work done); `total` is the whole.
_SPANS = {
    "conditioning": (0.0, 0.05, "done"),
    "denoising": (0.05, 0.80, "step"),
    "decoding": (0.85, 0.10, "chunk"),
    "muxing": (0.95, 0.05, "done"),
}
ENCODED = 0.05


def _reached(kind: str, event: gateway_pb2.JobEvent) -> float:
    """Where an event of a working stage puts the job."""
    start, width, field = _SPANS[kind]
    body = getattr(event, kind)
    done, total = getattr(body, field), body.total
    return start + width * (min(max(done / total, 0.0), 1.0) if total > 0 else 0.0)


def advance(current: float, event: gateway_pb2.JobEvent) -> float:
    """The progress after `event`, given the progress before it.

    Events that measure no work (accepted, waiting, and the failed / cancelled end) leave it unchanged.
    Within an attempt it never moves back: the encoder and the VAE encoder run together for fl2va / ref2va,
    so an `encoding` (0.05) may come before the last `conditioning` (up to 0.05). Only `retrying` (a new
    attempt from the start) returns it to 0."""
    kind = event.WhichOneof("kind")
    if kind == "retrying":
        return 0.0
    if kind == "done":
        return 1.0
    if kind == "encoding":
        return max(current, ENCODED)
    if kind in _SPANS:
        return max(current, _reached(kind, event))
    return current  # accepted, waiting, failed, cancelled (and kinds added later): no work measured


def progress(events: Iterable[gateway_pb2.JobEvent]) -> float:
    """The progress of a job whose events, in order, are `events` (0 for none)."""
    value = 0.0
    for event in events:
        value = advance(value, event)
    return value
