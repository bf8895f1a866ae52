"""Job events: which ones end a job, and one human line per event (the CLI's progress display)."""

from __future__ import annotations

from h3serve.v1 import gateway_pb2

TERMINAL = frozenset({"done", "failed", "cancelled"})


def is_terminal(event: gateway_pb2.JobEvent) -> bool:
    """The job's last event: it ended done, failed or cancelled."""
    return event.WhichOneof("kind") in TERMINAL


def _accepted(event: gateway_pb2.JobEvent) -> str:
    r = event.accepted.request
    steps = r.params.num_inference_steps
    return (
        f"accepted {event.job_id}: {r.height}x{r.width} (height x width), {r.num_frames} frames, "
        f"{steps} steps ({max(steps - 1, 0)} transformer forwards), seed {r.params.seed}"
    )


def _denoising(event: gateway_pb2.JobEvent) -> str:
    d = event.denoising
    compiled = f"  (compiled {d.compiled_graphs} graphs: a shape not warmed)" if d.compiled_graphs else ""
    return (
        f"denoising: forward {d.step}/{d.total}  {d.step_seconds:.2f} s/forward  "
        f"elapsed {d.elapsed_seconds:.1f} s  eta {d.eta_seconds:.1f} s{compiled}"
    )


_LINES = {
    "accepted": _accepted,
    "conditioning": lambda e: (
        f"encoding keyframes / references: encoder call {e.conditioning.done}/{e.conditioning.total}"
    ),
    "encoding": lambda e: (
        f"encoded ({'cache hit' if e.encoding.cache_hit else 'cache miss'}) in {e.encoding.seconds:.2f} s"
    ),
    "denoising": _denoising,
    "decoding": lambda e: f"decoding {e.decoding.chunk}/{e.decoding.total}",
    "muxing": lambda e: f"muxing {e.muxing.done}/{e.muxing.total} s",
    "retrying": lambda e: f"retrying: attempt {e.retrying.attempt}/{e.retrying.max_attempts}: {e.retrying.reason}",
    "waiting": lambda e: f"waiting for {e.waiting.stage} (up to {e.waiting.limit_s:g} s): {e.waiting.reason}",
    "done": lambda e: f"done: {e.done.video.file_name} ({e.done.video.bytes} bytes, {e.done.duration_s:.2f} s)",
    "failed": lambda e: f"failed: {e.failed.code_name}: {e.failed.message}",
    "cancelled": lambda e: f"cancelled: {e.cancelled.reason}",
}


def describe_event(event: gateway_pb2.JobEvent) -> str:
    """One human line per event."""
    return _LINES[event.WhichOneof("kind")](event)
