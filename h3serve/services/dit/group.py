"""The DiT group's control plane: rank 0 hands every request to all ranks, and they stop together.

Messages travel on a gloo group next to the compute group, so they never queue behind GPU
work. Rank 0's driver thread owns the group: it broadcasts each job (spec and conditioning
tensors), or an `idle` beat when there is none, so waiting ranks never outlive the collective
timeout and a dead rank shows within one beat. At every step boundary the ranks take one
small all-reduce of "stop?": rank 0 says yes when the client cancelled, and all leave the loop
at the same step. Any other failure breaks the group: rank 0 fails the requests it holds with
UNAVAILABLE and the reason, every rank exits, and the launcher starts the group again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from h3serve.common.errors import describe
from h3serve.runtime import compile_cache, wire
from h3serve.services.dit import attention, hold, parallel
from h3serve.services.dit.runner import DenoiseRunner, StepClock
from h3serve.v1 import dit_pb2

log = logging.getLogger("h3serve.dit.group")
IDLE, JOB, WARMUP = "idle", "job", "warmup"  # a warm-up job runs like a job and is not counted as served


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    host: str
    device: str


@dataclass
class Message:
    """What rank 0 broadcasts: a job with its inputs, or an idle beat."""

    kind: str
    spec: dit_pb2.DenoiseSpec | None = None
    tensors: dict[str, torch.Tensor] | None = None  # prompt_embeds, text_token_tags
    conditioning: dict | None = None  # the workflow's denoise inputs (keyframes, references)


class Cancelled(BaseException):
    """All ranks agreed to stop at a step boundary (a BaseException: diffusers' error logging lets it pass)."""


class ControlPlane:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def broadcast(self, message: Message | None = None) -> Message:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        received = box[0]
        assert received is not None  # rank 0's message: it always sends one
        return received

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank passes True: the one small collective per step."""
        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        return bool(vote.item())

    def gather(self, value) -> list:
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values


@dataclass(frozen=True)
class RankStats:
    peak_bytes: int  # peak memory during the last job
    steps_served: int  # steps this rank has run since it joined


@dataclass
class Outcome:
    """How one job ended, the same on every rank; `ranks` holds every rank's stats after it."""

    latents: dict[str, torch.Tensor] | None = None
    invalid: ValueError | None = None
    ranks: list[RankStats] = field(default_factory=list)
    condition_rows: tuple[int, int] = (0, 0)  # packed (video, audio) rows of keyframes / references

    @property
    def cancelled(self) -> bool:
        return self.latents is None and self.invalid is None


class GroupMember:
    """One rank's part in a job: the full denoise loop on its share of the sequence and weights."""

    def __init__(
        self, control: ControlPlane, runner: DenoiseRunner, device: torch.device, backend: str, max_math_tokens: int
    ) -> None:
        self.control, self.runner, self.device = control, runner, device
        self.backend, self.max_math_tokens = backend, max_math_tokens
        self.steps_served = 0

    def run(self, message: Message, on_step: Callable[[int, int], None], wants_stop: Callable[[], bool]) -> Outcome:
        spec, tensors = message.spec, message.tensors
        assert spec is not None and tensors is not None  # a job's (or warm-up's) message, not an idle beat

        def observe(step: int, total: int) -> None:
            self.steps_served += message.kind == JOB
            on_step(step, total)
            if self.control.any(wants_stop()):
                raise Cancelled

        parallel.reset_peak_memory(self.device)
        outcome = Outcome()
        try:
            embeds, conditioning = tensors["prompt_embeds"], message.conditioning or {}
            tokens = attention.packed_length(embeds.shape[1], spec, conditioning)
            with attention.no_math_kernel(self.backend, self.device, tokens, self.max_math_tokens):
                outcome.latents = self.runner.run(spec, embeds, tensors["text_token_tags"], observe, conditioning)
            outcome.condition_rows = self.runner.condition_rows
        except Cancelled:
            pass
        except ValueError as exc:  # the request's own fault, raised alike on every rank
            outcome.invalid = exc
        outcome.ranks = self.control.gather(RankStats(parallel.peak_memory_bytes(self.device), self.steps_served))
        return outcome


def follow(member: GroupMember) -> None:
    """Ranks above 0: run what rank 0 sends until the group breaks (the process then exits)."""
    while True:
        message = member.control.broadcast()
        if message.kind in (JOB, WARMUP):
            member.run(message, lambda step, total: None, lambda: False)


class JobFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


_END = object()


class Ticket:
    """One request as rank 0 holds it: the events for its RPC, and its cancel flag."""

    def __init__(self, job_id: str, message: Message) -> None:
        self.job_id, self.message = job_id, message
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def stream(self) -> Iterator[dit_pb2.DenoiseEvent]:
        """The RPC's events in order; raises JobFailed; ends early once the client is gone."""
        while True:
            try:
                item = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.cancelled.is_set():
                    return
                continue
            if item is _END:
                return
            if isinstance(item, JobFailed):
                raise item
            yield item


class Driver:
    """Rank 0's owner of the group: one job at a time, in arrival order, on a thread of its own."""

    def __init__(self, member: GroupMember, heartbeat_s: float, on_broken: Callable[[str], None]) -> None:
        self.member, self.heartbeat_s, self.on_broken = member, heartbeat_s, on_broken
        self.inbox: queue.Queue[Ticket] = queue.Queue()
        self.broken: str | None = None
        self.current: Ticket | None = None
        self.requests_served = 0
        self.ranks: list[RankStats] = []
        self.hold = hold.from_environment()  # a test's hold point (hold.py); None outside tests
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="dit-group", daemon=True).start()

    def submit(self, spec: dit_pb2.DenoiseSpec, tensors: dict[str, torch.Tensor], conditioning: dict) -> Ticket:
        text = {name: tensors[name] for name in ("prompt_embeds", "text_token_tags")}
        ticket = Ticket(spec.job_id, Message(JOB, spec, text, conditioning))
        with self._lock:
            if self.broken:
                raise JobFailed(grpc.StatusCode.UNAVAILABLE, self.broken)
            self.inbox.put(ticket)
        return ticket

    @property
    def steps_served(self) -> int:
        return self.member.steps_served

    @property
    def busy(self) -> bool:
        return self.current is not None

    def fail(self, reason: str) -> None:
        """The group is unusable: every request held here ends UNAVAILABLE with `reason`."""
        with self._lock:
            if self.broken:
                return
            self.broken = reason
            held = [self.current] if self.current else []
            while not self.inbox.empty():
                held.append(self.inbox.get_nowait())
        log.error("DiT group failed: %s", reason)
        for ticket in held:
            ticket.events.put(JobFailed(grpc.StatusCode.UNAVAILABLE, reason))
        self.on_broken(reason)

    def _loop(self) -> None:
        try:
            while True:
                try:
                    ticket = self.inbox.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    self.member.control.broadcast(Message(IDLE))
                    continue
                with self._lock:  # a failure in between must not miss this ticket
                    if self.broken or ticket.cancelled.is_set():
                        ticket.events.put(JobFailed(grpc.StatusCode.UNAVAILABLE, self.broken or "cancelled"))
                        continue
                    self.current = ticket
                self._serve(ticket)
                self.current = None
        except BaseException as exc:  # a rank died, a collective timed out, or a bug: the group is gone
            self.fail(
                f"DiT group of {self.member.control.world_size} rank(s) broke and restarts: {describe(exc, lines=1)}"
            )

    def _serve(self, ticket: Ticket) -> None:
        queue_seconds = time.perf_counter() - ticket.submitted
        started = time.perf_counter()
        self.member.control.broadcast(ticket.message)
        clock, graphs = StepClock(), compile_cache.compiled_graphs()

        def on_step(step: int, total: int) -> None:
            nonlocal graphs
            before, graphs = graphs, compile_cache.compiled_graphs()  # rank 0's process: it compiles as every rank
            ticket.events.put(
                dit_pb2.DenoiseEvent(
                    step=dit_pb2.StepProgress(
                        step=step, total=total, seconds=clock.lap(), compiled_graphs=graphs - before
                    )
                )
            )
            if self.hold:
                self.hold.wait(step, ticket.cancelled.is_set)

        outcome = self.member.run(ticket.message, on_step, ticket.cancelled.is_set)
        self.ranks = outcome.ranks
        if outcome.invalid is not None:
            ticket.events.put(JobFailed(grpc.StatusCode.INVALID_ARGUMENT, describe(outcome.invalid, lines=1)))
            return
        if outcome.cancelled:
            log.info("job %s: cancelled by the client; all ranks stopped at the same step", ticket.job_id)
            ticket.events.put(_END)
            return
        latents, spec = outcome.latents, ticket.message.spec
        assert latents is not None and spec is not None  # neither refused nor cancelled; a job's message
        for chunk in wire.encode_many(latents):
            ticket.events.put(dit_pb2.DenoiseEvent(chunk=chunk))
        self.requests_served += 1
        seconds, steps = time.perf_counter() - started, spec.params.num_inference_steps - 1
        log.info(
            "job %s: %d steps in %.2f s on %d rank(s) (waited %.2f s)",
            ticket.job_id,
            steps,
            seconds,
            self.member.control.world_size,
            queue_seconds,
        )
        video_rows, audio_rows = outcome.condition_rows
        ticket.events.put(
            dit_pb2.DenoiseEvent(
                summary=dit_pb2.DenoiseSummary(
                    seconds=seconds,
                    queue_seconds=queue_seconds,
                    steps=steps,
                    condition_video_rows=video_rows,
                    condition_audio_rows=audio_rows,
                )
            )
        )
        ticket.events.put(_END)
