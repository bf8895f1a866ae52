"""The job store's contract: what the gateway persists and the atomic steps it takes on it.

Jobs, their event logs, stage records, stage timings and artifact files' records. Each job also keeps
its progress (h3serve/gateway/jobs/progress.py), advanced by every event in the event's transaction, and
whether it is in the bin (soft delete: `set_deleted`). Every method is a coroutine and never blocks the
event loop: an implementation does its I/O elsewhere (SQLite on one thread of its own: sqlite/). Each
method is one transaction; in particular a job's terminal state and its terminal event are written
together (`finish`), so no reader ever sees one without the other.

The store holds no policy: how many attempts a job gets and why it runs again are the job runner's
(h3serve/gateway/jobs/runner.py). Two implementations: SQLite (sqlite/, one gateway) and PostgreSQL
(postgres/, a store several gateways can share).

Ownership: a gateway runs a job only while it holds the job's lease (`claim`): its id, a fence counter that
every claim raises, and a time the lease runs to. Each write about a running job that takes a `lease` is fenced:
it is written only while that lease is still the job's (and the job unfinished), renews the lease, and otherwise
raises Fenced and writes nothing. So a gateway that lost a job (paused or cut off past its lease while another
took it) can never write over the new holder: at-least-once compute, exactly-once commit.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from h3serve.common.errors import Unavailable
from h3serve.v1 import gateway_pb2

TERMINAL_STATES = (gateway_pb2.JOB_STATE_SUCCEEDED, gateway_pb2.JOB_STATE_FAILED, gateway_pb2.JOB_STATE_CANCELLED)
UNFINISHED_STATES = (gateway_pb2.JOB_STATE_QUEUED, gateway_pb2.JOB_STATE_RUNNING)


class QueueFull(Exception):
    """Submit refused: the bound on unfinished jobs is reached (the gateway's, or `client`'s own)."""

    def __init__(self, depth: int, bound: int, client: str = ""):
        self.depth, self.bound, self.client = depth, bound, client
        whose = f"client {client!r} has" if client else "the job queue is full:"
        super().__init__(f"{whose} {depth} unfinished jobs, the bound is {bound}")


class RequestIdConflict(Exception):
    """Submit refused: the request_id already names a job made from a different request."""

    def __init__(self, request_id: str, job_id: str):
        super().__init__(f"request_id: {request_id!r} already names job {job_id} with a different request")


class Fenced(Exception):
    """A fenced write refused: the job's lease is no longer the writer's (another gateway claimed it), or the job
    ended. The writer must stop working on the job and write nothing more of it."""

    def __init__(self, job_id: str, lease: Lease):
        super().__init__(f"job {job_id}: lease {lease.fence} of {lease.gateway_id} is no longer the job's")


class StoreUnavailable(Unavailable):
    """The store's server is out of reach (down, restarting, cut off, every connection busy past the wait): nothing of
    the call was written. Callers wait and try again (a running job's writes: runner.py) or refuse with UNAVAILABLE
    (a client's call: common/guard.py). Only a shared store's backend raises it (PostgreSQL); SQLite never does."""

    def __init__(self, server: str, reason: str, retry_after_s: float):
        super().__init__(f"the job store's {server} is unreachable: {reason}", retry_after_s)


@dataclass(frozen=True)
class Lease:
    """A gateway's hold on a job: who, the fence counter its claim set, and how long each renewal lasts."""

    gateway_id: str
    fence: int
    seconds: float


@dataclass(frozen=True)
class Unfinished:
    """A queued or running job, as a start-up finds it."""

    job_id: str
    state: int
    request: gateway_pb2.ResolvedRequest
    attempts: int
    last_stage: str  # the stage of its last stage record ("" if it never reached one)
    restarts: int = 0  # gateway restarts that caught one of its stage calls in progress (runner.py: free re-runs)
    in_stage: bool = False  # a stage call of it was in progress (started, not ended) when the gateway stopped
    fence: int = 0  # the fence counter (as `claim` returns it: the claim's own)
    holder: str = ""  # (as `claim` returns it) the gateway whose lease it was before the claim ("": none ever)


@dataclass(frozen=True)
class Ownership:
    """Who submits a job (h3serve/gateway/tenants/): the client, its own bound on unfinished jobs (0: none) and
    the job's webhook endpoint (empty: none)."""

    client: str
    max_unfinished: int = 0
    webhook_url: str = ""


@dataclass(frozen=True)
class Outgoing:
    """A webhook event in the outbox, due to be sent (h3serve/gateway/webhooks/delivery.py)."""

    event_id: str
    job_id: str
    client: str
    url: str
    body: bytes
    attempts: int  # made so far


@dataclass(frozen=True)
class StoredArtifact:
    artifact_id: str
    key: str  # its blob's (h3serve/gateway/blobs.py)
    bytes: int
    created: float


class JobStore(Protocol):
    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Nothing, when the store answers; StoreUnavailable, saying why, when it does not (the gateway's health)."""

    # Jobs and events.

    async def submit(
        self,
        job_id: str,
        request: gateway_pb2.ResolvedRequest,
        request_id: str = "",
        digest: str = "",
        max_unfinished: int = 0,
        first_event: gateway_pb2.JobEvent | None = None,
        owner: Ownership | None = None,
    ) -> tuple[gateway_pb2.Job, bool]:
        """Create a QUEUED job (and its first event) owned by `owner` (None: the default client); returns (job,
        created). A request_id the owner used before returns its job with created False (RequestIdConflict if
        `digest` differs); QueueFull when `max_unfinished` (> 0) jobs, or the owner's own bound of its own, are
        queued or running, and nothing is written."""

    async def append_event(
        self, job_id: str, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent:
        """Store the event as the job's next seq, stamped now, and advance the job's progress with it; returns the
        stored copy. KeyError: unknown job. (Every method that writes an event advances the progress too.) With a
        `lease`, here and in every method that takes one: Fenced unless the lease is still the job's, and renewed."""

    async def start_attempt(self, job_id: str, lease: Lease | None = None) -> int:
        """Mark the job RUNNING and count one more attempt; returns its number (0: the job is already final)."""

    async def requeue(
        self,
        job_id: str,
        event: gateway_pb2.JobEvent,
        count_attempt: bool = True,
        interrupted: str = "",
        count_restart: bool = False,
        lease: Lease | None = None,
    ) -> gateway_pb2.JobEvent | None:
        """Queue an unfinished job again with `event` (its `retrying`); without `count_attempt` the interrupted
        attempt is taken back. `interrupted`: the error its stage records still open get (a dead gateway's passes);
        `count_restart`: one more restart caught it in a stage (`Unfinished.restarts`). Returns the stored event,
        None when the job is already final."""

    async def finish(
        self, job_id: str, state: int, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent | None:
        """Set a terminal state with its terminal event (its `failed` also becomes the job's error), and, for a job
        with a webhook endpoint that ended SUCCEEDED or FAILED, its event in the outbox. Returns the stored event,
        None when the job was already final: a finished job never changes again."""

    async def unfinished(self) -> list[Unfinished]:
        """Queued and running jobs, oldest first."""

    # Ownership.

    async def claim(self, gateway_id: str, lease_s: float, job_id: str = "") -> Unfinished | None:
        """Take the oldest unfinished job whose lease has run out (a new job has none; `job_id`: only that one), for
        `lease_s` from now, raising its fence; returns it with the new fence and its lease's holder before, None when
        there is none. Two claims never take one job while its lease runs."""

    async def renew(self, job_id: str, lease: Lease) -> None:
        """Extend the lease `lease.seconds` from now. Fenced: it is no longer the job's."""

    async def release(self, job_id: str, lease: Lease) -> None:
        """End the lease now (a gateway shutting down), so the job can be claimed at once. Fenced: not the job's."""

    async def expire(self, gateway_id: str) -> int:
        """End now every lease `gateway_id` holds (its earlier run's, at its start); returns how many."""

    async def request_cancel(self, job_id: str) -> str | None:
        """Mark the unfinished job cancel-requested, for whichever gateway runs it (on PostgreSQL also announced in
        the same transaction: listen.py's CANCELS). Returns the gateway whose lease holds it now ("" when no lease
        holds it: nobody runs it), None when the job is unknown or already final (nothing marked)."""

    async def cancel_requested(self, job_id: str) -> bool:
        """Whether a cancel was requested for the job (`request_cancel`)."""

    # Stage records and timings.

    async def stage_enqueued(self, job_id: str, attempt: int, stage: str, lease: Lease | None = None) -> int:
        """A new stage record (the job joined the stage's queue); returns its id."""

    async def stage_update(self, record_id: int, lease: Lease | None = None, **values) -> None:
        """Set columns of a stage record: started, finished, replica, bytes_in, bytes_out, tries, error."""

    async def set_stage_seconds(self, job_id: str, stage: str, seconds: float, lease: Lease | None = None) -> None: ...

    # Artifacts.

    async def add_artifact(
        self, job_id: str, kind: str, artifact: gateway_pb2.Artifact, key: str, lease: Lease | None = None
    ) -> None:
        """Record the artifact stored as the blob `key` (a relative name, never a local path)."""

    async def artifact(self, artifact_id: str, client: str | None = None) -> tuple[gateway_pb2.Artifact, str] | None:
        """The artifact and its blob key (`client`: only of that client's jobs; None: any)."""

    async def artifacts_oldest_first(self) -> list[StoredArtifact]: ...

    async def delete_artifact(self, artifact_id: str) -> None: ...

    def retention_turn(self) -> AbstractAsyncContextManager[bool]:
        """Around a retention pass: whether this gateway runs it now. Gateways sharing the store take turns (one
        at a time; a gateway that would wait skips its pass instead); one gateway alone always runs it."""

    # Reads.

    async def get_job(self, job_id: str, client: str | None = None) -> gateway_pb2.Job | None:
        """The job (also one in the bin), with its stage records, progress and webhook; `client`: only if it is
        that client's (None: any client's)."""

    async def list_jobs(
        self,
        states: list[int],
        limit: int,
        cursor: int = 0,
        deleted: bool = False,
        oldest_first: bool = False,
        client: str | None = None,
    ) -> tuple[list[gateway_pb2.Job], int]:
        """Up to `limit` jobs in `states` (empty: all) of `client` (None: every client's), newest first or
        `oldest_first`, only those in the bin when `deleted`, else only those outside it; after the job at `cursor`
        in that order when > 0 (a returned cursor or a `position`). Returns them and the cursor to continue from
        (0: no more)."""

    async def position(self, job_id: str, client: str | None = None) -> int:
        """The job's place in the listing order, a cursor for `list_jobs` (0: unknown job, or not `client`'s)."""

    async def set_deleted(self, job_id: str, deleted: bool) -> gateway_pb2.Job | None:
        """Put the job in the bin (Job.deleted: now) or take it out (0); already there: unchanged. Only the bin
        mark changes, never the state. Returns the job, None when unknown."""

    async def count_by_state(self, client: str | None = None) -> dict[int, int]:
        """Jobs by state, of `client` (None: every client's)."""

    async def events(self, job_id: str, after_seq: int = 0) -> list[gateway_pb2.JobEvent]: ...

    # Uploads' owners (an asset is stored once per content; each client that uploaded it owns it).

    async def own_asset(self, asset_id: str, client: str) -> bool:
        """Record that `client` uploaded the asset; returns whether it had not before."""

    async def owned_assets(self, asset_ids: list[str], client: str) -> set[str]:
        """Those of `asset_ids` that `client` uploaded (the default client also owns uploads from before owners
        were recorded: assets nobody owns)."""

    # The webhook outbox.

    async def due_webhooks(self, now: float, limit: int, hold_s: float = 0.0) -> list[Outgoing]:
        """Up to `limit` undelivered events whose next attempt is due at `now`, the longest due first. With `hold_s`
        they are taken: in the same transaction each one's next attempt moves to `now + hold_s`, so no other gateway
        sends it meanwhile, and one whose sender dies before `webhook_attempted` is due again after that (a store
        one gateway owns, SQLite, needs no taking and ignores it)."""

    async def webhook_attempted(self, event_id: str, status: int, error: str, delivered: bool, next_at: float) -> None:
        """Record an attempt: one more, its HTTP status (0: none) and error, delivered now or not, the next attempt's
        time (0: none)."""
