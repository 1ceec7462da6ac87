"""The durable job store: jobs and their items in SQL (SQLite in WAL mode, or PostgreSQL), images as
PNG files under a data directory.

State machine of an item: ``queued -> running -> done | failed | cancelled``; a running item holds
a *lease* (owner, token, expiry). Schedulers renew the leases of the items they run; an item whose
lease expired (its scheduler or worker died) is leasable again, so restarting anything loses
nothing. A job's state is derived from its items' states, never stored twice.

Exactly-once results: ``commit_result`` marks an item done only while its lease holds, renaming its
file into place before that transaction commits (its docstring gives the argument).

Concurrency: on SQLite every writing transaction is ``BEGIN IMMEDIATE`` (one writer at a time, no
lock upgrades that fail with "database is locked"); on PostgreSQL leasing uses ``FOR UPDATE SKIP
LOCKED``, so several schedulers or API processes may share one database. Times are ``time.time()``
of the writing host: schedulers on several hosts need synchronised clocks (NTP) for leases.

``Store`` is one class made of a part per concern, each a mixin over ``StoreBase`` (``store.base``: the
engine, the migration, transactions, change notifications):

- ``store.job``, ``JobsMixin``: submit, get, list, cancel, retry, delete; the counts the service reports;
- ``store.leases``, ``LeasesMixin``: lease, renew, release, fail; uncharged requeues, the crash-loop bound,
  poison isolation;
- ``store.results``, ``ResultsMixin``: an image committed exactly once; previews;
- ``store.outbox``, ``OutboxMixin``: webhooks due, claimed, recorded;
- ``store.retention``, ``RetentionMixin``: finished jobs past retention, stale temp files;
- ``store.uploads``, ``UploadsMixin``: edits' uploaded images (quota, retention) and the inputs a job keeps;
- ``store.loras``, ``LorasMixin``: the adapter registry (LoRA files and who may use them);
- ``store.workers``, ``WorkersMixin``: the workers each scheduler runs and the models they serve.

The schema and its migrations are ``store.tables``; ``store.changes`` wakes waiters on a job's changes.
"""

from __future__ import annotations

from dit_serve.server.store.base import StoreBase, StoreError, _driver_url  # noqa: F401 (tests read it here)
from dit_serve.server.store.changes import CHANNEL, Changes
from dit_serve.server.store.job import IdempotencyConflict, JobsMixin, QueueFull, dump_manifest, job_state
from dit_serve.server.store.loras import LoraNameTaken, LorasMixin
from dit_serve.server.store.leases import Lease, LeasesMixin, lease_shape, requeue_backoff
from dit_serve.server.store.outbox import OutboxMixin
from dit_serve.server.store.results import ResultsMixin
from dit_serve.server.store.retention import RetentionMixin
from dit_serve.server.store.tables import (DEFAULT_TENANT, MIGRATIONS, SCHEMA_VERSION, api_keys, items, jobs, meta,
                                           loras, schema, tenants, uploads, workers)
from dit_serve.server.store.uploads import InputMissing, UploadQuotaFull, UploadsMixin
from dit_serve.server.store.workers import WorkerRow, WorkersMixin

__all__ = ["CHANNEL", "DEFAULT_TENANT", "MIGRATIONS", "SCHEMA_VERSION", "Changes", "IdempotencyConflict", "Lease", "LoraNameTaken",
           "QueueFull", "Store", "StoreError", "WorkerRow", "api_keys", "dump_manifest", "items", "job_state", "jobs",
           "lease_shape", "loras", "meta", "requeue_backoff", "schema", "tenants", "InputMissing", "UploadQuotaFull", "uploads",
           "workers"]


class Store(JobsMixin, LeasesMixin, ResultsMixin, OutboxMixin, RetentionMixin, UploadsMixin, LorasMixin,
            WorkersMixin, StoreBase):
    """Jobs, items, leases and results. Thread-safe: each call uses its own pooled connection.

    ``max_requeues`` bounds the infrastructure failures an item survives; ``poison_crashes`` the crashes
    of its worker while it ran alone (docs/reliability.md, failure accounting)."""
