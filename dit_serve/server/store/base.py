"""What every part of the store stands on: the database engine (SQLite in WAL mode, or PostgreSQL), the
schema's creation and migration, transactions, and the change notifications' wiring."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event, func, inspect, select, text
from sqlalchemy.engine import make_url

from dit_serve.server.store.changes import CHANNEL, Changes
from dit_serve.server.store.tables import MIGRATIONS, SCHEMA_VERSION, api_keys, meta, schema, tenants

log = logging.getLogger("dit_serve.server.store")  # the store's parts log as one

NO_LEASE = dict(lease_owner=None, lease_token=None, lease_expires=None)  # an item's lease columns, cleared


class StoreError(RuntimeError):
    """A database this version of dit-serve cannot use (for example, one written by a newer version)."""


class StoreBase:
    """The engine, the migration and the transactions the store's parts share (``Store`` combines them)."""

    def __init__(self, url: str, data_dir: Path, max_requeues: int = 50, poison_crashes: int = 2):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.max_requeues, self.poison_crashes = max_requeues, poison_crashes
        sqlite = make_url(_driver_url(url)).get_backend_name() == "sqlite"
        # a database server's connections can drop (restarts, idle timeouts): each is pinged before use;
        # an SQLite file's cannot, and the ping would be one more statement in every transaction
        self.engine = create_engine(_driver_url(url), pool_pre_ping=not sqlite)
        if self.engine.dialect.name == "sqlite":
            _sqlite_setup(self.engine)
        postgres = self.engine.dialect.name == "postgresql"
        self.local_reads = not postgres  # a read is a local file's, not a round trip to a database server
        self.changes = Changes(publish=self._publish if postgres else None)
        # set when items may have become queued (a submission, a retry, a release; on PostgreSQL any change
        # another process publishes): the scheduler waits on it instead of finding new work a tick later
        self.work = threading.Event()
        # set with ``work`` by the store only (never by the scheduler's own wake-ups, its answers arriving):
        # items may really have become queued, so leasing before committing finished images can pay off
        self.queued = threading.Event()
        self._migrate()

    def _migrate(self) -> None:
        """Create the tables in an empty database, or bring an older one up to ``SCHEMA_VERSION`` (one
        transaction, so a failed upgrade leaves the database as it was). A newer one is refused."""
        with self._tx() as conn:  # SQLite: BEGIN IMMEDIATE; PostgreSQL: a lock, so one process migrates
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7346120984)"))
            tables = set(inspect(conn).get_table_names())
            if "jobs" not in tables:
                meta.create_all(conn)
                conn.execute(schema.insert().values(version=SCHEMA_VERSION))
                return
            if "dit_serve_schema" not in tables:  # the first layout
                schema.create(conn)
                version = 1
            else:
                version = conn.execute(select(func.max(schema.c.version))).scalar() or 1
            if version > SCHEMA_VERSION:
                raise StoreError(f"the database has schema version {version}, newer than this dit-serve's "
                                 f"({SCHEMA_VERSION}): upgrade dit-serve to use it")
            if version == SCHEMA_VERSION:
                return
            for v in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[v]:
                    if statement == "tables":
                        meta.create_all(conn, tables=[tenants, api_keys])
                    elif statement.startswith("create "):
                        meta.create_all(conn, tables=[meta.tables[name] for name in statement.split()[1:]])
                    else:
                        conn.execute(text(statement))
                log.warning("job store upgraded from schema version %d to %d", v, v + 1)
            conn.execute(schema.delete())
            conn.execute(schema.insert().values(version=SCHEMA_VERSION))

    def close(self) -> None:
        self.engine.dispose()

    def _publish(self, job_ids: list[str]) -> None:
        """PostgreSQL: tell the other processes (``listen``) which jobs changed, after the write committed."""
        try:
            with self.engine.connect() as conn:
                for i in range(0, len(job_ids), 200):  # NOTIFY payloads stay under 8000 bytes
                    conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": CHANNEL, "p": ",".join(job_ids[i:i + 200])})
                conn.commit()
        except Exception as e:  # waiters fall back to their slow poll; the write itself stands
            log.warning("could not publish a change notification: %s", e)

    def listen(self, stop: threading.Event) -> None:
        """PostgreSQL: wake this process's waiters (images endpoint, event streams) on changes other
        processes publish (LISTEN/NOTIFY), until ``stop`` is set; reconnects after a lost connection."""
        import psycopg

        url = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not stop.is_set():
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._new_work()
                            self.changes.notify(note.payload.split(","), local=True)
            except Exception as e:  # the database restarted, a network blip: waiters poll meanwhile
                log.warning("change notifications lost (%s); reconnecting", e)
                stop.wait(1.0)

    def _new_work(self) -> None:
        self.queued.set()
        self.work.set()

    @contextmanager
    def _tx(self, write: bool = True):
        options = {} if write else {"dit_serve_read": True}
        with self.engine.connect().execution_options(**options) as conn, conn.begin():
            yield conn

    def _any(self, query, params: dict | None = None) -> bool:
        """Whether ``query`` (a select of at most one row) finds a row: a cheap read before taking the write
        lock, which an idle scheduler makes often."""
        with self._tx(write=False) as conn:
            return conn.execute(query, params or {}).first() is not None


def _driver_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 (the driver this project installs), not psycopg2."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def _sqlite_setup(engine) -> None:
    """WAL (readers never block the writer), a busy timeout, and BEGIN IMMEDIATE for writes."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let the "begin" hook below issue BEGIN itself
        cur = dbapi_conn.cursor()
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=30000"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("dit_serve_read") else "BEGIN IMMEDIATE")

