"""The job store's tables and their migrations (SQLAlchemy Core; SQLite and PostgreSQL).

The schema is versioned: ``SCHEMA_VERSION`` is stored in the database, and ``MIGRATIONS[v]`` brings a
database at version v to v + 1 in place (``dit_serve.server.store.Store`` runs them in one transaction).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text

DEFAULT_TENANT = "default"  # jobs of a service without tenant keys, and of the [server] api_keys

meta = MetaData()
jobs = Table(
    "jobs", meta,
    Column("id", String(32), primary_key=True),
    Column("model", String(200), nullable=False),
    Column("params", Text, nullable=False),  # JSON of JobParams
    Column("num_items", Integer, nullable=False),
    Column("created_at", Float, nullable=False, index=True),
    Column("cancelled", Boolean, nullable=False, default=False),
    Column("priority", Integer, nullable=False, default=0),
    # a URL told when the job finishes: pending (or sending, claimed until webhook_next) -> sent | failed
    Column("webhook_url", Text),
    Column("webhook_state", String(10)),
    Column("webhook_attempts", Integer, nullable=False, default=0),
    Column("webhook_next", Float),  # pending: not before this time; sending: the claim expires then
    Column("webhook_error", Text),
    # a client's Idempotency-Key: a retried submission finds its job instead of storing a second one
    Column("idempotency_key", String(200)),
    Column("request_hash", String(64)),  # what was asked under that key: a reuse must ask the same
    Column("tenant", String(64), nullable=False, default=DEFAULT_TENANT),  # who submitted it: who may see it
    Index("jobs_tenant_idempotency_key", "tenant", "idempotency_key", unique=True),  # NULLs never collide
    Index("jobs_webhook_due", "webhook_state", "webhook_next"),
    Index("jobs_tenant_created", "tenant", "created_at"),
)
items = Table(
    "items", meta,
    Column("job_id", String(32), primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("model", String(200), nullable=False),  # copied from the job: the lease query needs no join
    Column("created_at", Float, nullable=False),   # copied from the job: FIFO order across jobs
    Column("priority", Integer, nullable=False, default=0),  # copied from the job: higher is leased first
    Column("tenant", String(64), nullable=False, default=DEFAULT_TENANT),  # copied from the job: quotas
    Column("label", Integer, nullable=False),
    Column("prompt", Text),  # text models: the item's prompt (its label is then 0)
    Column("seed", BigInteger, nullable=False),
    Column("state", String(10), nullable=False),
    Column("step", Integer, nullable=False, default=0),
    Column("total_steps", Integer, nullable=False),
    Column("attempts", Integer, nullable=False, default=0),  # leases taken (runs started)
    # failure accounting (docs/reliability.md): infrastructure failures requeue without charging the item
    Column("requeues", Integer, nullable=False, default=0),      # back to the queue after an infrastructure failure
    Column("crashes", Integer, nullable=False, default=0),       # its worker died (or its step raised) holding it
    Column("solo_crashes", Integer, nullable=False, default=0),  # ... while it ran alone, isolated as a suspect
    Column("not_before", Float, nullable=False, default=0.0),    # backoff: not leased again before this time
    Column("lease_owner", String(200)),
    Column("lease_token", String(32)),
    Column("lease_expires", Float),
    Column("path", String(300)),  # relative to the data dir; set once, when the item is done
    Column("error", Text),
    Column("finished_at", Float),
    Index("items_leasable", "state", "model", "priority", "created_at"),
    Index("items_tenant_state", "tenant", "state"),
)
# API keys belong to tenants; only a salted hash of each key's secret is stored (dit_serve.server.keys)
tenants = Table(
    "tenants", meta,
    Column("name", String(64), primary_key=True),
    Column("max_queued", Integer),    # None: [limits] tenant_max_queued_items
    Column("max_priority", Integer),  # None: [limits] tenant_max_priority
    Column("created_at", Float, nullable=False),
)
api_keys = Table(
    "api_keys", meta,
    Column("id", String(16), primary_key=True),  # public part of the key: dsk_<id>_<secret>
    Column("tenant", String(64), nullable=False),
    Column("role", String(10), nullable=False),  # user | admin
    Column("salt", String(32), nullable=False),
    Column("hash", String(64), nullable=False),  # HMAC-SHA256(salt, secret)
    Column("name", String(200)),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
)

# images uploaded for edits (POST /v1/uploads): the file is uploads/<id> under the data dir; counted per tenant
uploads = Table(
    "uploads", meta,
    Column("id", String(32), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("format", String(8), nullable=False),
    Column("width", Integer, nullable=False),
    Column("height", Integer, nullable=False),
    Column("filename", String(200)),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float),  # retention deletes it then (None: kept until deleted)
    Index("uploads_tenant", "tenant"),
    Index("uploads_expires", "expires_at"),
)

# the workers each scheduler runs, as it last wrote them (``store.workers``): what any API process tells of them
workers = Table(
    "workers", meta,
    Column("owner", String(200), primary_key=True),  # the scheduler (its lease owner)
    Column("key", String(100), primary_key=True),    # the worker's slot
    Column("state", String(16), nullable=False),     # starting | ready | switching
    Column("models", Text, nullable=False),          # JSON list: the models it serves now
    Column("loading", Text, nullable=False),         # JSON list: the models it is loading
    Column("node", String(64)),
    Column("resource", String(64)),
    Column("held", Integer, nullable=False, default=0),  # items leased to it
    Column("started_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# adapters (POST /v1/loras, [workers] lora_dir): the file is loras/<name>.safetensors under the data dir. One name
# space: workers register adapters by name. A tenant's own, or shared (uploaded with the admin key, or from lora_dir)
loras = Table(
    "loras", meta,
    Column("name", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),   # who registered it
    Column("shared", Boolean, nullable=False, default=False),  # every tenant sees it
    Column("model", String(200), nullable=False),   # the model it was checked against ("": any of its family)
    Column("family", String(50), nullable=False),   # that model's family ("": any)
    Column("format", String(16), nullable=False),   # peft | kohya-flux | kohya-sd3
    Column("rank", Integer, nullable=False),
    Column("modules", Integer, nullable=False),     # linears it targets
    Column("sha256", String(64), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("source", String(10), nullable=False),   # upload | dir
    Column("created_at", Float, nullable=False),
    Index("loras_tenant", "tenant"),
)

# The schema's version, stored in the database. Version 1 is the first layout (it had no version
# table); 2 added the idempotency columns, 3 job priorities, 4 webhooks, 5 tenants, API keys and failure
# accounting, 6 prompts, 7 uploads, 8 the workers table, 9 adapters. MIGRATIONS[v] brings v to v + 1 in place; "table:NAME"
# creates that table.
SCHEMA_VERSION = 9
schema = Table("dit_serve_schema", meta, Column("version", Integer, primary_key=True))
MIGRATIONS = {
    1: ["ALTER TABLE jobs ADD COLUMN idempotency_key VARCHAR(200)",
        "ALTER TABLE jobs ADD COLUMN request_hash VARCHAR(64)",
        "CREATE UNIQUE INDEX jobs_idempotency_key ON jobs (idempotency_key)"],
    2: ["ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE items ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
        "DROP INDEX items_leasable",
        "CREATE INDEX items_leasable ON items (state, model, priority, created_at)"],
    3: ["ALTER TABLE jobs ADD COLUMN webhook_url TEXT",
        "ALTER TABLE jobs ADD COLUMN webhook_state VARCHAR(10)",
        "ALTER TABLE jobs ADD COLUMN webhook_attempts INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN webhook_next FLOAT",
        "ALTER TABLE jobs ADD COLUMN webhook_error TEXT",
        "CREATE INDEX jobs_webhook_due ON jobs (webhook_state, webhook_next)"],
    4: ["ALTER TABLE jobs ADD COLUMN tenant VARCHAR(64) NOT NULL DEFAULT 'default'",
        "DROP INDEX jobs_idempotency_key",
        "CREATE UNIQUE INDEX jobs_tenant_idempotency_key ON jobs (tenant, idempotency_key)",
        "CREATE INDEX jobs_tenant_created ON jobs (tenant, created_at)",
        "ALTER TABLE items ADD COLUMN tenant VARCHAR(64) NOT NULL DEFAULT 'default'",
        "ALTER TABLE items ADD COLUMN requeues INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE items ADD COLUMN crashes INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE items ADD COLUMN solo_crashes INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE items ADD COLUMN not_before FLOAT NOT NULL DEFAULT 0",
        "CREATE INDEX items_tenant_state ON items (tenant, state)",
        "tables"],  # create the tables new in this version (tenants, api_keys)
    5: ["ALTER TABLE items ADD COLUMN prompt TEXT"],
    6: ["table:uploads"],
    7: ["table:workers"],
    8: ["table:loras"],
}
