"""The job store on PostgreSQL ([gateway] store_url = "postgresql://..."): several gateways on one database.

schema.py: the tables as numbered migrations; store.py: PostgresJobStore, the async JobStore on psycopg 3's pool.
Needs the `postgres` extra (psycopg, psycopg-pool); imported only when a store_url names PostgreSQL.
"""

from h3serve.gateway.jobs.postgres.store import PostgresJobStore

__all__ = ["PostgresJobStore"]
