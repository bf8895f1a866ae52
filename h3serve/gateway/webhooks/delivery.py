"""The outbox sent: each event the store's outbox holds is POSTed until its endpoint answers 2xx, at least once.

An event enters the outbox in the transaction that ends its job (JobStore.finish), so no end is lost between the
state and the send; what is due is read from the store, so a gateway killed mid-send sends it again at its next start
(the same webhook-id: receivers drop repeats). An attempt that fails (no answer within [gateway] webhook_timeout_s, or
any status but 2xx: a redirect too) is tried again after webhook_backoff_s, doubling up to webhook_max_backoff_s, until
webhook_max_attempts. Each attempt's outcome is written on the job's outbox row, which GetJob shows.

Several gateways on one store each run a sender: reading what is due takes it (JobStore.due_webhooks' `hold_s`), so
each event goes out from one of them; one that dies mid-send leaves it due again once the hold has passed, and another
sends it then (at least once; once per event while the gateways keep running). A store out of reach pauses sending.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from h3serve.common.bounds import brief
from h3serve.common.config import GatewayConfig
from h3serve.gateway.jobs.store import JobStore, Outgoing, StoreUnavailable
from h3serve.gateway.tenants.registry import Tenants
from h3serve.gateway.webhooks.signing import headers

log = logging.getLogger("h3serve.gateway.webhooks")
POLL_S = 0.5  # how often the outbox is read for what is due: an event leaves at most this long after its job ends
# Events sent at once, each on a thread of the sender's own: endpoints slow to answer never hold up the threads the
# gateway's own disk work runs on (asyncio's default executor).
SENDERS = 8
USER_AGENT = "h3serve-webhooks"
# How long an event taken to be sent stays another gateway's to leave alone: its connect, its send and its answer are
# each bounded by webhook_timeout_s, and the margin covers its outcome's write.
HOLD_MARGIN_S = 5.0


def hold_s(timeout_s: float) -> float:
    return 3 * timeout_s + HOLD_MARGIN_S


def post(url: str, body: bytes, signed: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """POST `body` to `url` (blocking): (HTTP status, "") or (0, why there was none). Redirects are not followed."""
    parts = urlsplit(url)
    connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_type(parts.hostname or "", parts.port, timeout=timeout_s)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("POST", path, body, {**signed, "content-type": "application/json", "user-agent": USER_AGENT})
        response = connection.getresponse()
        response.read()
        return response.status, ""
    except (OSError, http.client.HTTPException) as exc:
        return 0, brief(exc)
    finally:
        connection.close()


class WebhookSender:
    def __init__(self, config: GatewayConfig, store: JobStore, tenants: Tenants) -> None:
        self.store, self.tenants = store, tenants
        self.timeout_s, self.max_attempts = config.webhook_timeout_s, config.webhook_max_attempts
        self.backoff_s, self.max_backoff_s = config.webhook_backoff_s, config.webhook_max_backoff_s

    async def run(self) -> None:
        """Send what is due, for ever (the gateway cancels it at its stop: an attempt cut short is sent again)."""
        threads = ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="h3serve-webhooks")
        try:
            while True:
                try:
                    due = await self.store.due_webhooks(time.time(), SENDERS, hold_s(self.timeout_s))
                    await asyncio.gather(*(self._attempt(item, threads) for item in due))
                except StoreUnavailable as exc:  # an outcome unwritten is sent again once its hold has passed
                    log.warning("webhooks wait %g s for the job store: %s", exc.retry_after_s, exc)
                    await asyncio.sleep(exc.retry_after_s)
                    continue
                if len(due) < SENDERS:
                    await asyncio.sleep(POLL_S)
        finally:
            threads.shutdown(wait=False, cancel_futures=True)

    def _delay(self, attempts: int) -> float:
        return min(self.backoff_s * 2 ** (attempts - 1), self.max_backoff_s)

    async def _attempt(self, item: Outgoing, threads: ThreadPoolExecutor) -> None:
        client = self.tenants.named(item.client)
        if client is None or not client.webhook_secret:
            status, error = 0, f"client {item.client!r} has no webhook_secret in the clients file to sign with"
        else:
            signed = headers(client.webhook_secret, item.event_id, int(time.time()), item.body)
            status, error = await asyncio.get_running_loop().run_in_executor(
                threads, post, item.url, item.body, signed, self.timeout_s
            )
            if status and not 200 <= status < 300:
                error = f"the endpoint answered HTTP {status}"
        delivered, attempts = 200 <= status < 300, item.attempts + 1
        next_at = 0.0 if delivered or attempts >= self.max_attempts else time.time() + self._delay(attempts)
        await self.store.webhook_attempted(item.event_id, status, error, delivered, next_at)
        if not delivered:
            log.warning(
                "webhook %s of job %s to %s, attempt %d of %d: %s%s",
                item.event_id,
                item.job_id,
                item.url,
                attempts,
                self.max_attempts,
                error,
                "; given up" if not next_at else f"; next in {next_at - time.time():.0f} s",
            )
