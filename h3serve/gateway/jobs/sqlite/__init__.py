"""The job store on one SQLite file (WAL): jobs, their event logs, stage records, timings, artifacts.

schema.py: the tables and their migrations; identity.py: the store id that makes a missing, emptied or foreign
store refused; refusals.py: why a file is refused; database.py: the methods on one connection, run on one thread,
with ownership.py (the leases), outbox.py (the webhook outbox) and asset_owners.py (uploads' owners); store.py:
SqliteJobStore, the async JobStore the gateway holds.
"""

from h3serve.gateway.jobs.sqlite.refusals import BUSY_WAIT_S
from h3serve.gateway.jobs.sqlite.store import SqliteJobStore

__all__ = ["BUSY_WAIT_S", "SqliteJobStore"]
