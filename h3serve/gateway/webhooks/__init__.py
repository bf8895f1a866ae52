"""Webhooks: a job's end POSTed to its client's endpoint as OpenAI's video events, signed as Standard Webhooks.

`endpoint.py` (which URLs an endpoint may be), `signing.py` (`whsec_` secrets and the webhook-* headers),
`event.py` (the event body, written into the store's outbox with the job's terminal state), `delivery.py` (the
outbox sent at least once, with back-off, across gateway restarts). docs/webhooks.md says what is promised.
"""
