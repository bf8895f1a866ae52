"""A webhook endpoint for tests: a small HTTP server on loopback that records every delivery, refusing some."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REFUSED = 500


class Receiver:
    """Records every POST (path, headers, body, status) and answers REFUSED to the first `fail_first` of each
    webhook-id (every one on a path ending "/never"), 200 after; each answer after `delay_s` (a slow endpoint)."""

    def __init__(self, fail_first: int, delay_s: float = 0.0) -> None:
        self.fail_first, self.delay_s, self.received, self.lock = fail_first, delay_s, [], threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                time.sleep(receiver.delay_s)
                with receiver.lock:
                    seen = sum(1 for r in receiver.received if r[1]["webhook-id"] == self.headers["webhook-id"])
                    status = REFUSED if seen < receiver.fail_first or self.path.endswith("/never") else 200
                    receiver.received.append((self.path, dict(self.headers.items()), body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def attempts(self, event_id: str) -> list[tuple]:
        with self.lock:
            return [r for r in self.received if r[1]["webhook-id"] == event_id]

    def delivered(self, event_id: str) -> bool:
        return any(r[3] == 200 for r in self.attempts(event_id))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
