"""Tenants: the gateway's named clients, each with its own token, jobs, uploads, bound and webhook endpoint.

`clients.py` (the clients file: tokens hashed at rest, read and checked whole), `registry.py` (`Tenants`: who a
call's token names, reloaded on SIGHUP; what a caller without a token may reach). docs/tenants.md says what is
promised.
"""
