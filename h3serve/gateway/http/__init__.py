"""The HTTP door: OpenAI's /v1/videos, Server-Sent Events of every step, asset uploads and the web console.

A thin client of the gateway's own gRPC API, run on the gateway's event loop (door.py): every request becomes
gRPC calls on a private in-process channel, carrying the caller's bearer token, so the door has exactly the
gRPC door's jobs, limits, errors and auth. app.py routes; videos.py shapes the JSON; events.py streams SSE;
errors.py turns gRPC statuses into OpenAI's error JSON.
"""
