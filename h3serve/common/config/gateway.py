"""[gateway]: the public API's process: its doors, the stage addresses (each a list of replicas), admission,
retention, the stall and outage limits, tokens and webhooks."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from h3serve.common.config.base import (
    DAY_S,
    DEFAULT_STEPS,
    MAX_PROMPT_CHARS,
    MAX_ROWS,
    MAX_STEPS,
    OUTAGE_DEFAULTS,
    STALL_DEFAULTS,
    OpenPart,
    Phase,
    Port,
    Section,
    StageName,
    Steps,
)
from h3serve.model.rules import Geometry

# A host name (or IPv4 address), kept in lower case, with a leading "." for every name under it: [gateway] webhook_hosts
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
WebhookHost = Annotated[str, StringConstraints(to_lower=True, pattern=rf"^\.?{_HOST_LABEL}(\.{_HOST_LABEL})*$")]


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _joined(value):
    """A list of replica addresses is kept as the comma-separated string `GatewayConfig.replicas` splits."""
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return ",".join(value)
    return value


def _some_address(value: str) -> str:
    if not _addresses(value):
        raise ValueError("at least one address is required")
    return value


Addresses = Annotated[str, BeforeValidator(_joined), AfterValidator(_some_address)]


MESSAGE_ENVELOPE_BYTES = 64 << 10  # a message's fields other than its largest one (a chunk's file name, ...)


class GatewayConfig(Section):
    host: str = "127.0.0.1"
    port: Port = 50050
    data_dir: str = "var/gateway"  # this gateway's own: its lock, id, SQLite database (and blobs by default)
    # Artifacts and uploads (docs/storage.md, blobs): empty is data_dir; gateways sharing a PostgreSQL store point it
    # at one shared filesystem (NFS, a Kubernetes ReadWriteMany volume)
    blob_dir: str = ""
    # The job store on PostgreSQL instead of data_dir's SQLite file (docs/storage.md; the `postgres` extra)
    store_url: str = Field(default="", pattern=r"^(postgres(ql)?://.*)?$")
    # A stage address may also be a list (or a comma-separated string) of replica addresses.
    encoder: Addresses = "127.0.0.1:50051"  # stage addresses
    dit: Addresses = "127.0.0.1:50052"
    vae: Addresses = "127.0.0.1:50053"
    max_prompt_chars: PositiveInt = MAX_PROMPT_CHARS  # at most the encoder's
    max_prompt_tokens: PositiveInt = 2048  # the prompt in the tokenizer's tokens (a character is up to 4)
    max_steps: Steps = MAX_STEPS  # at most the DiT's
    default_steps: Steps = DEFAULT_STEPS  # at most max_steps
    encode_deadline_s: PositiveFloat = 600.0  # per stage call
    denoise_deadline_s: PositiveFloat = 3600.0
    decode_deadline_s: PositiveFloat = 1800.0
    # A stage call failing UNAVAILABLE (the replica is down or restarting) is tried again, on the next replica,
    # with back-off from retry_backoff_s doubling to max_backoff_s, until the stage's outage limit has passed. Past
    # it the job waits on while `h3serve up` says it is bringing the stage's service back (a start or restart, each
    # within [supervisor] start_timeout_s), and for the limit again from when it serves (common/supervision.py).
    retry_backoff_s: NonNegativeFloat = 0.5
    max_backoff_s: PositiveFloat = 5.0
    outage_s: dict[StageName, PositiveFloat] = Field(default_factory=lambda: dict(OUTAGE_DEFAULTS))
    max_image_bytes: PositiveInt = 20 << 20  # UploadAsset limits, per asset
    max_video_bytes: PositiveInt = 100 << 20
    max_audio_bytes: PositiveInt = 30 << 20
    max_image_pixels: PositiveInt = 8192 * 8192
    max_video_pixels: PositiveInt = 3840 * 2160  # per frame
    max_video_seconds: PositiveFloat = 60.0
    max_audio_seconds: PositiveFloat = 60.0
    max_rows: PositiveInt = MAX_ROWS  # admission (at most the DiT's): packed DiT rows per request (text,
    # conditioning, generated)
    # The encoder, DiT and VAE share one card too small for two of their stages at once: every stage call waits for
    # the card (one at a time, in arrival order) instead of overlapping with another job's (docs/deploy/small-gpus.md);
    # `h3serve up` starts the model services one at a time too, each once the one before it serves (cli/launcher.py),
    # and no stage call takes a turn while `up` (re)starts one (gateway/stages/card.py)
    stages_take_turns: bool = False
    geometry: Geometry = Field(default_factory=Geometry)  # from [model]
    model_dir: str = ""  # from [model] dir: admission counts text rows with its tokenizer and processor
    # the deployment file it was read from (load_deploy sets it): admission plans the largest request each workflow
    # can hold from the whole deployment (h3serve/common/ceilings.py); empty: no plan, max_rows and capacity only
    deploy_file: str = ""
    max_unfinished_jobs: NonNegativeInt = 64  # queue bound: queued + running jobs; beyond it Submit is refused
    # with RESOURCE_EXHAUSTED (0: no bound)
    max_attempts: PositiveInt = 3  # runs of one job: re-runs after a stalled stage; a gateway restart spends none
    # (its own bound: runner.MAX_RESTART_RERUNS re-runs of a job caught in a stage)
    # Per-phase stall limits in seconds, measured from the phase's last progress event.
    stall_s: dict[Phase, PositiveFloat] = Field(default_factory=lambda: dict(STALL_DEFAULTS))
    # Admission capacity: {workflow: {"HxW" or "*": max packed-sequence rows}}; a canvas not listed
    # (and no "*") is not limited. See docs/capacity.md for measuring it.
    capacity: dict[str, dict[str, PositiveInt]] = Field(default_factory=dict)
    metrics_port: Port = 0  # Prometheus /metrics on this HTTP port (0: off)
    metrics_host: str = "127.0.0.1"
    http_port: Port = 0  # the HTTP door: OpenAI's /v1/videos, SSE events, the web console (0: off)
    http_host: str = "127.0.0.1"  # served with tls_cert / tls_key and auth_token as the gRPC door
    auth_token: str = ""  # bearer token the public API requires (empty: no check); its client is named "default"
    # Named clients, each with its own token, jobs and uploads (docs/tenants.md): a TOML file of [clients.NAME]
    # tables, tokens hashed; read again on SIGHUP. Empty: none. With it or auth_token, every call needs a token
    clients_file: str = ""
    max_unfinished_jobs_per_client: NonNegativeInt = 0  # each client's bound on its queued + running jobs (0: none;
    # a client's own max_unfinished_jobs in the clients file overrides it); max_unfinished_jobs bounds them all
    # What answers without a token when the gateway has one (health always does): "reflection" (gRPC server
    # reflection), "docs" (the HTTP door's /openapi.json and /docs), "metrics" (else an admin client's token); with
    # "@loopback", only to callers on this machine
    open_without_token: Annotated[tuple[OpenPart, ...], Field(strict=False)] = (
        "docs@loopback",
        "reflection@loopback",
        "metrics@loopback",
    )
    # Webhooks (docs/webhooks.md): an endpoint that does not answer 2xx within webhook_timeout_s is tried again after
    # webhook_backoff_s, doubling up to webhook_max_backoff_s, webhook_max_attempts times in all, across restarts
    webhook_timeout_s: PositiveFloat = 10.0
    webhook_backoff_s: PositiveFloat = 1.0
    webhook_max_backoff_s: PositiveFloat = 600.0
    webhook_max_attempts: PositiveInt = 20
    # The hosts a request's own webhook_url may name: "hooks.example.com" that name, ".example.com" any name under it.
    # Empty: any host (only clients with a webhook_secret may name one). The clients file's endpoints are the
    # operator's own and are not held to it.
    webhook_hosts: Annotated[tuple[WebhookHost, ...], Field(strict=False)] = ()
    tls_cert: str = ""  # PEM files: serve the public API over TLS
    tls_key: str = ""
    stage_tls_ca: str = ""  # PEM root for TLS stage services (empty: plaintext to the stages)
    stage_token: str = ""  # sent to every stage service as `authorization: Bearer <token>` (their
    # auth_token; empty: none)
    max_request_bytes: PositiveInt = 4 << 20  # largest request message the public API accepts (uploads come in chunks)
    # Retention, enforced after every job and every minute (0: keep for ever / no cap).
    artifact_max_age_s: NonNegativeFloat = 7 * DAY_S  # artifacts older than this are deleted
    artifact_max_bytes: NonNegativeInt = 50 << 30  # beyond this many artifact bytes the oldest go first
    # A finished clip whose artifact the disk cannot hold waits this long for space (its job's `waiting` event says
    # where, what is free and what it needs), is written when space returns, and past it fails naming the disk
    # (0: fails at once)
    artifact_space_wait_s: NonNegativeFloat = 1800.0
    asset_max_age_s: NonNegativeFloat = 7 * DAY_S  # uploads older than this go unless a queued or running job
    # names them

    @field_validator("outage_s")
    @classmethod
    def _every_stage(cls, limits: dict[str, float]) -> dict[str, float]:
        """A table naming some stages keeps the defaults of the others (a stage without a limit failed its jobs)."""
        return {**OUTAGE_DEFAULTS, **limits}

    @field_validator("default_steps")
    @classmethod
    def _within_max_steps(cls, steps: int, info: ValidationInfo) -> int:
        if "max_steps" in info.data and steps > info.data["max_steps"]:
            raise ValueError(f"must be within 2..max_steps ({info.data['max_steps']}), got {steps}")
        return steps

    def replicas(self, stage: str) -> tuple[str, ...]:
        """The replica addresses of a stage ("encoder", "dit", "vae")."""
        return _addresses(getattr(self, stage))

    def largest_upload_bytes(self) -> int:
        return max(self.max_image_bytes, self.max_video_bytes, self.max_audio_bytes)

    def largest_message_bytes(self) -> int:
        """The gRPC door's receive limit: the largest legal message (a request of max_request_bytes, or a whole
        upload sent as one chunk) and room for its envelope. Every message a limit of a field would refuse arrives
        (up to this), so that it is refused by name (INVALID_ARGUMENT), never as RESOURCE_EXHAUSTED by the
        transport, which reads like a full queue."""
        return max(self.max_request_bytes, self.largest_upload_bytes()) + MESSAGE_ENVELOPE_BYTES
