"""Typed configuration for every h3serve process, read from one TOML deployment file.

Each section ([encoder], [dit], [vae], [gateway]) maps onto a dataclass; command-line flags
override single fields. `[model] dir` points every model service at a local diffusers model
directory; empty means the built-in tiny preset.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from h3serve.model.rules import Geometry


@dataclass(frozen=True)
class ModelServiceConfig:
    """One model service process (encoder, dit or vae)."""

    host: str = "127.0.0.1"
    port: int = 0
    model_dir: str = ""            # empty: tiny preset
    device: str = "cpu"            # torch device inside the process, e.g. "cuda" (it sees only `gpus`)
    gpus: str = ""                 # CUDA_VISIBLE_DEVICES for the process, e.g. "1,2"; empty: inherit
    dtype: str = "float32"
    attention_backend: str = "native"  # dit, vae: a diffusers attention backend, "flash4" (FlashAttention 4)
                                       # or "cudnn_fp8" (dit, opt-in: FP8 attention, changes the numbers)
    cache_bytes: int = 256 << 20   # encoder embedding cache bound
    max_prompt_chars: int = 8192   # encoder: longest prompt accepted
    max_raw_bytes: int = 512 << 20  # vae: largest raw.npz payload include_raw may produce
    threads: int = 0               # torch intra-op threads; 0: torch's default
    tls_cert: str = ""             # PEM certificate chain + key: serve TLS instead of plaintext
    tls_key: str = ""
    workflows: tuple[str, ...] = ("t2va", "fl2va", "ref2va")  # dit: served workflows (decides the partitions loaded)
    geometry: Geometry = field(default_factory=Geometry)  # from [model]
    compile: bool = False          # dit, vae: torch.compile the repeated blocks (h3serve/runtime/fastpath.py)
    fp8: bool = False              # dit: fp8 W8A8 block linears (torchao, Hopper); changes the numbers
    tile_batch: int = 1            # vae: spatial tiles per decoder call; 1 is diffusers' own loop (exact)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class DiTConfig(ModelServiceConfig):
    """The DiT service: one process group of `world_size` ranks started through torchrun.

    Rank 0 hosts the gRPC server; every rank holds the transformer. See README "The sharded DiT".
    """

    world_size: int = 1              # ranks in the group (all nodes together); 1 runs the same code path
    nnodes: int = 1                  # nodes; world_size / nnodes ranks start on each (torchrun --nproc-per-node)
    rdzv_endpoint: str = ""          # multi-node: host:port of the c10d rendezvous (torchrun --rdzv-endpoint)
    rdzv_id: str = "h3serve-dit"     # multi-node: job id shared by the nodes' launchers
    fsdp: bool = False               # shard the weights with FSDP2 (memory) instead of replicating them (speed)
    ulysses_degree: int = 0          # sequence split over heads (all-to-all); 0: world_size when ring_degree is 1
    ring_degree: int = 1             # sequence split over keys/values (ring); ulysses x ring = world_size
    max_restarts: int = 3            # group restarts after a rank dies, then the service exits
    restart_backoff_s: float = 1.0   # wait before restart k: backoff * 2^(k-1), at most 30 s
    collective_timeout_s: float = 600.0  # a collective that takes longer fails the group (it restarts)
    heartbeat_s: float = 5.0         # idle ranks hear from rank 0 this often; a dead rank shows within this
    max_math_tokens: int = 4096      # GPU: above this packed length attention never runs on the MATH kernel


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50050
    data_dir: str = "var/gateway"     # SQLite database and artifacts
    encoder: str = "127.0.0.1:50051"  # stage addresses
    dit: str = "127.0.0.1:50052"
    vae: str = "127.0.0.1:50053"
    max_prompt_chars: int = 8192
    max_steps: int = 200
    default_steps: int = 50
    encode_deadline_s: float = 600.0  # per stage call
    denoise_deadline_s: float = 3600.0
    decode_deadline_s: float = 1800.0
    retry_attempts: int = 3           # tries for a stage call that fails UNAVAILABLE
    retry_backoff_s: float = 0.5      # first back-off, doubled per try
    max_image_bytes: int = 20 << 20   # UploadAsset limits, per asset
    max_video_bytes: int = 100 << 20
    max_audio_bytes: int = 30 << 20
    max_image_pixels: int = 8192 * 8192
    max_video_pixels: int = 3840 * 2160  # per frame
    max_video_seconds: float = 60.0
    max_audio_seconds: float = 60.0
    max_rows: int = 200_000           # admission: packed DiT rows per request (text, conditioning, generated)
    geometry: Geometry = field(default_factory=Geometry)  # from [model]
    model_dir: str = ""               # from [model] dir: admission counts text rows with its tokenizer and processor
    # A stage address may also be a list (or a comma-separated string) of replica addresses.
    max_unfinished_jobs: int = 64     # queue bound: queued + running jobs; beyond it Submit is RESOURCE_EXHAUSTED
    max_attempts: int = 2             # runs of one job: re-runs after a gateway restart or a stalled stage
    # Per-phase stall limits in seconds, measured from the phase's last progress event.
    stall_s: dict = field(default_factory=lambda: dict(STALL_DEFAULTS))
    # Admission capacity: {workflow: {"HxW" or "*": max packed-sequence rows}}; a canvas not listed
    # (and no "*") is not limited. See docs/capacity.md for measuring it.
    capacity: dict = field(default_factory=dict)
    metrics_port: int = 0             # Prometheus /metrics on this HTTP port (0: off)
    metrics_host: str = "127.0.0.1"
    auth_token: str = ""              # bearer token the public API requires (empty: no check)
    tls_cert: str = ""                # PEM files: serve the public API over TLS
    tls_key: str = ""
    stage_tls_ca: str = ""            # PEM root for TLS stage services (empty: plaintext to the stages)
    max_request_bytes: int = 4 << 20  # largest request message the public API accepts (uploads come in chunks)
    artifact_max_age_s: float = 0.0   # retention: delete artifacts older than this (0: keep)
    artifact_max_bytes: int = 0       # retention: keep at most this many artifact bytes, oldest go first (0: no cap)

    def replicas(self, stage: str) -> tuple[str, ...]:
        """The replica addresses of a stage ("encoder", "dit", "vae"): a list, or one comma-separated string."""
        value = getattr(self, stage)
        items = value.split(",") if isinstance(value, str) else value
        addresses = tuple(item.strip() for item in items if item.strip())
        if not addresses:
            raise ValueError(f"[gateway] {stage}: at least one address is required")
        return addresses


# Phases the watchdog times: the stage call starts a phase; each progress event restarts its clock.
STALL_DEFAULTS = {"encode": 300.0, "denoise": 900.0, "decode": 600.0, "mux": 300.0}


@dataclass(frozen=True)
class DeployConfig:
    encoder: ModelServiceConfig = field(default_factory=lambda: ModelServiceConfig(port=50051))
    dit: DiTConfig = field(default_factory=lambda: DiTConfig(port=50052))
    vae: ModelServiceConfig = field(default_factory=lambda: ModelServiceConfig(port=50053))
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def service(self, name: str):
        return getattr(self, name)


SERVICES = ("encoder", "dit", "vae")


def _apply(section_obj, values: dict, where: str):
    known = {f.name for f in fields(section_obj)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    return replace(section_obj, **values)


def load_deploy(path: str | Path | None) -> DeployConfig:
    """Read a deployment file. `[model] dir` is the default model_dir of every model service."""
    config = DeployConfig()
    if path is None:
        return config
    data = tomllib.loads(Path(path).read_text())
    unknown = set(data) - {"model", *SERVICES, "gateway"}
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}")
    model = dict(data.get("model", {}))
    model_dir = model.pop("dir", "")
    geometry = _apply(Geometry(), model, f"{path} [model]")
    updates = {}
    for name in SERVICES:
        section = {"model_dir": model_dir, "geometry": geometry, **data.get(name, {})}
        if "workflows" in section:
            section["workflows"] = tuple(section["workflows"])
        updates[name] = _apply(config.service(name), section, f"{path} [{name}]")
    gateway = _apply(config.gateway, {"geometry": geometry, "model_dir": model_dir, **data.get("gateway", {})},
                     f"{path} [gateway]")
    addresses = {name: f"{updates[name].host}:{updates[name].port}" for name in SERVICES}
    explicit = data.get("gateway", {})
    gateway = replace(gateway, **{k: v for k, v in addresses.items() if k not in explicit})
    return DeployConfig(gateway=gateway, **updates)


def override(section, **flags):
    """Apply command-line flags that were given (not None) to one config section."""
    return replace(section, **{k: v for k, v in flags.items() if v is not None})
