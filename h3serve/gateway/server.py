"""`h3serve serve gateway`: the gateway's parts wired together, served until SIGTERM or SIGINT.

The parts: the job store (SQLite, or PostgreSQL at store_url), the event hub, the stage caller (stages and their
replicas), the job runner, the asset and artifact stores, the admission's text-row counter, the API servicer and
health (the store's and the stages'). The gateway process never imports torch (tests/test_layers.py checks it).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2_grpc

from h3serve.common import logs
from h3serve.common.ceilings import Ceilings
from h3serve.common.config import GatewayConfig, load_deploy
from h3serve.common.disk import DiskFull, full_named
from h3serve.common.guard import AsyncGuard
from h3serve.common.processes import Refused, lock_directory, refuse
from h3serve.common.server import EXCLUSIVE_PORT, GRACE_SECONDS, bind, enable_reflection, refuse_port_in_use
from h3serve.gateway.admission.capacity import CapacityTable
from h3serve.gateway.admission.text_rows import TextRows
from h3serve.gateway.api.health import StageHealth
from h3serve.gateway.api.servicer import GatewayServicer
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetLimits
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.gateway.http.door import HttpDoor, private_address
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.jobs.gateway_id import gateway_id
from h3serve.gateway.jobs.runner import JobRunner
from h3serve.gateway.jobs.sqlite import SqliteJobStore
from h3serve.gateway.jobs.store import JobStore
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import STAGE_NAMES
from h3serve.gateway.stages.calls import StageCaller
from h3serve.gateway.tenants.clients import ClientsFileError
from h3serve.gateway.tenants.registry import Tenants
from h3serve.gateway.webhooks.delivery import WebhookSender
from h3serve.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:  # imported where a store_url names PostgreSQL: psycopg is the `postgres` extra's
    from h3serve.gateway.jobs.postgres.listen import Listener

log = logging.getLogger("h3serve.gateway")
RETENTION_PERIOD_S = 60.0
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


async def _retention_loop(runner: JobRunner) -> None:
    while True:
        await runner.retention.enforce()
        await asyncio.sleep(RETENTION_PERIOD_S)


def _load_text_rows(config: GatewayConfig) -> TextRows:
    try:
        return TextRows.load(config.model_dir, config.geometry)
    except Exception as exc:
        raise RuntimeError(
            f"[gateway] model_dir {config.model_dir or '(tiny preset)'!r}: admission counts text rows "
            f"with the model's tokenizer and processor, which did not load: {exc}"
        ) from exc


def admission(config: GatewayConfig) -> CapacityTable:
    """The bounds Submit admits by: max_rows, the hand-set capacity table, and the plan's ceilings for the deployment's
    cards (h3serve/common/ceilings.py) where the table has no entry. A deployment whose cards cannot hold even the
    smallest clip is refused (EXIT_REFUSED, the plan's reason); where the plan holds less than max_rows admits, the
    log says so."""
    if not config.deploy_file:
        return CapacityTable(config.capacity, config.max_rows)
    planned = Ceilings(load_deploy(config.deploy_file))
    if reason := planned.refusal():
        refuse(f"[gateway] {config.deploy_file}: {reason}")
    if not planned.bounded:
        log.info("admission: max_rows and the capacity table only: the plan bounds nothing (%s)", planned.unbounded)
    for line in planned.lines() if planned.bounded else []:
        log.info("admission: %s", line.strip())
    for line in planned.lowered():
        log.warning("admission: %s", line)
    return CapacityTable(config.capacity, config.max_rows, planned)


async def _open_store(config: GatewayConfig, data_dir: Path) -> JobStore:
    """The job store: PostgreSQL at [gateway] store_url when set, else data_dir's SQLite file. A file no restart can
    fix (damaged, or locked by another program), a full disk or a database that cannot be reached is refused, with
    the way out, and exits EXIT_REFUSED."""
    if config.store_url:
        return await _open_postgres(config.store_url)
    try:
        with full_named(str(data_dir)):
            return SqliteJobStore(str(data_dir / "jobs.sqlite"))
    except (Refused, DiskFull) as exc:
        refuse(f"[gateway] {exc}")


async def _open_postgres(url: str) -> JobStore:
    try:
        from h3serve.gateway.jobs.postgres import PostgresJobStore
    except ImportError as exc:
        refuse(f"[gateway] store_url names PostgreSQL, but {exc.name} is not installed: pip install h3serve[postgres]")
    try:
        return await PostgresJobStore.open(url)
    except Exception as exc:  # psycopg's and the pool's errors: the server is down, refuses us, or times out
        refuse(f"[gateway] store_url: the job store's PostgreSQL cannot be used ({exc}); start it, or fix store_url")


def _store_listener(config: GatewayConfig, hub: EventHub, runner: JobRunner) -> Listener | None:
    """On PostgreSQL, what the store announces (events and cancels from any gateway) reaching this gateway's
    watchers and jobs (gateway/jobs/postgres/listen.py); None on SQLite."""
    if not config.store_url:
        return None
    from h3serve.gateway.jobs.postgres.listen import Listener

    return Listener(config.store_url, runner.gateway_id, hub.announced, runner.cancel, hub.reread)


def _tenants(config: GatewayConfig) -> Tenants:
    """The clients; a clients file that cannot be used is refused (EXIT_REFUSED), naming the client and key."""
    try:
        return Tenants(config)
    except ClientsFileError as exc:
        refuse(f"[gateway] clients_file: {exc}")


def _http_door(config: GatewayConfig, server: grpc.aio.Server, tenants: Tenants):
    """The HTTP door (h3serve/gateway/http/), when configured: it calls this server on a private address."""
    if not config.http_port:
        return None
    bind(server, private_address())
    return HttpDoor(config, tenants)


async def serve_async(config: GatewayConfig, capacity: CapacityTable | None = None) -> None:
    data_dir = Path(config.data_dir)
    tenants = _tenants(config)
    store = await _open_store(config, data_dir)
    metrics = GatewayMetrics(STAGE_NAMES)
    hub = EventHub(store)
    caller = StageCaller(config, metrics)
    blobs = DirectoryBlobs(config.blob_dir or config.data_dir)
    assets = AssetStore(blobs, str(data_dir / "assets"), AssetLimits.from_config(config))
    artifacts = ArtifactStore(blobs)
    runner = JobRunner(config, store, hub, caller, artifacts, metrics, assets, gateway_id=gateway_id(data_dir))
    text_rows = await asyncio.to_thread(_load_text_rows, config)
    loop = asyncio.get_running_loop()
    # The scrape runs on the metrics server's thread: it asks the store through the event loop.
    metrics.watch(
        lambda: asyncio.run_coroutine_threadsafe(store.count_by_state(), loop).result(timeout=10),
        lambda: {name: queue.depth for name, queue in runner.queues.items()},
    )
    health = StageHealth(caller, [SERVICE_NAME], store)
    server = grpc.aio.server(
        interceptors=[AsyncGuard(identify=tenants.identify)],
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", config.largest_message_bytes()),
            EXCLUSIVE_PORT,
        ],
    )
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(config, store, hub, runner, health, assets, text_rows, capacity, tenants), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection(server, [SERVICE_NAME])
    bind(server, f"{config.host}:{config.port}", config.tls_cert, config.tls_key)
    door = _http_door(config, server, tenants)
    if config.metrics_port:
        metrics.serve(config.metrics_host, config.metrics_port, tenants.metrics_allowed)
    if door:  # before the gRPC port opens: once health answers, the HTTP port is open too
        await door.start()
    await server.start()
    listener = _store_listener(config, hub, runner)
    if listener:
        listener.start()
    await runner.resume()
    claims = loop.create_task(runner.claim_loop())
    retention = loop.create_task(_retention_loop(runner))
    webhooks = loop.create_task(WebhookSender(config, store, tenants).run())
    log.info(
        "gateway on %s:%d (%s); metrics on %s",
        config.host,
        config.port,
        "; ".join(f"{service} {', '.join(config.replicas(service))}" for service in caller.replicas),
        f"{config.metrics_host}:{config.metrics_port}" if config.metrics_port else "off",
    )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, tenants.reload)  # new or revoked tokens without a restart
    await stop.wait()
    log.info("stopping (grace %.0f s)", GRACE_SECONDS)
    health.stopping = True
    if door:
        await door.stop()
    claims.cancel()
    retention.cancel()
    webhooks.cancel()
    await runner.shutdown()
    if listener:
        await listener.stop()
    await server.stop(GRACE_SECONDS)
    await caller.close()
    await store.close()


def serve(config: GatewayConfig) -> None:
    """Serve until SIGTERM or SIGINT, owning `data_dir` alone: two gateways on one job store and artifact tree
    would run each other's jobs again and delete each other's files. A second one exits EXIT_REFUSED."""
    logs.setup("gateway")
    # before the store opens: a restart would not free them
    refuse_port_in_use(f"{config.host}:{config.port}")
    for host, port in ((config.metrics_host, config.metrics_port), (config.http_host, config.http_port)):
        if port:
            refuse_port_in_use(f"{host}:{port}")
    try:
        with full_named(config.data_dir):  # the lock file records its holder: a write
            lock = lock_directory(config.data_dir)
    except (Refused, DiskFull) as exc:
        refuse(f"[gateway] data_dir {exc}")
    with lock:
        asyncio.run(serve_async(config, admission(config)))
