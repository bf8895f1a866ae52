"""The job store on one SQLite file (WAL): jobs, their event logs, stage records, timings, artifacts.

schema.py: the tables and how rows read back; identity.py: the store id that makes a missing, emptied or foreign
store refused; database.py: the methods on one connection, run on one thread; store.py: SqliteJobStore, the
async JobStore the gateway holds.
"""

from h3serve.gateway.jobs.sqlite.refusals import BUSY_WAIT_S
from h3serve.gateway.jobs.sqlite.store import SqliteJobStore

__all__ = ["BUSY_WAIT_S", "SqliteJobStore"]
