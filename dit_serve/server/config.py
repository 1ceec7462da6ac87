"""Typed service configuration, loaded from a TOML file; every field has a default, so no file
is needed (``dit-serve serve`` alone: local Ray, SQLite under ./dit-serve-data, digits on the CPU).

    [server]
    host = "127.0.0.1"
    port = 8000
    api_keys = []              # e.g. ["..."]: /v1 requests then need "Authorization: Bearer <key>"
                                # (or set DIT_SERVE_API_KEY for `dit-serve serve`)

    [store]
    url = ""                    # empty: SQLite (WAL) at <data_dir>/jobs.db; or postgresql://user@host/db
    data_dir = "dit-serve-data" # PNG results (shared storage when several API processes serve them)
    lease_seconds = 30
    retention_hours = 0         # delete finished jobs and their images after this long; 0 keeps them

    [ray]
    address = ""                # empty: start a local Ray; "auto" or "ray://..." joins a cluster

    [workers]
    models = ["digits", "digits-text"]
    resource = "auto"           # auto (one worker per GPU, else one CPU worker), GPU, CPU, or a custom
    max_batch = 64              # resource name: one worker per unit of it on each node
                                # graph buckets are the powers of two up to max_batch

    [limits]
    max_items_per_job = 10000

    [autoscale]                 # off by default: one worker per GPU (or the CPU worker), every model
    enabled = false             # true: workers by the backlog, nodes asked of Ray's autoscaler, idle ones stop
    min_workers = 0             # 0: scale to zero
    max_workers = 8
    target_drain_s = 300        # workers per model = ceil(steps left / (rate x target_drain_s))
    idle_timeout_s = 300

    [autoscale.placement]       # models pinned to nodes by Ray node labels or custom resources, e.g.
                                # "flux-dev-1024" = {labels = {gpu = "h100"}}

    [webhooks]                  # jobs with a webhook_url are POSTed to it when they finish
    secret = ""                 # set: deliveries are signed (X-Dit-Serve-Signature: sha256=<hmac>)
    max_attempts = 8            # retried with backoff (2 s, doubling) until a 2xx answer
    allow_hosts = []            # loopback, private, link-local and multicast destinations are refused
                                # (no redirect is followed); list internal receivers here: names,
                                # addresses or networks, e.g. ["hooks.internal", "10.0.0.0/8"]

Components receive their own section (``StoreConfig``, ``WorkerConfig``...), never the whole file.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from dit_serve.errors import ConfigError  # defined on the SDK side: the CLI catches it without this module
from workers.config import WorkerConfig  # the [workers] section: defined once, beside the worker it configures

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    public_url: str = Field("", description="base of image URLs in responses; empty: the request's own")
    api_keys: tuple[SecretStr, ...] = Field((), description="when set, every /v1 request needs "
                                            "'Authorization: Bearer <one of them>' (several: rotate keys); "
                                            "these keys act as the admin of the tenant 'default'")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="larger request bodies get a 413")
    read_timeout_s: float = Field(30.0, gt=0, le=3600, description="a request whose body has not arrived "
                                                                   "within this long gets a 408")
    access_log: bool = Field(True, description="log each request (method, path, status, ms) at info level on "
                                               "the logger dit_serve.access; `dit-serve serve` shows it")
    cancel_on_disconnect: bool = Field(True, description="the images endpoint cancels the job of a client "
                                                         "that hung up before it finished")

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for k in keys:
            v = k.get_secret_value()
            if len(v) < 8 or not v.isprintable() or " " in v:
                raise ValueError("an API key must be at least 8 printable characters without spaces")
        return keys


class StoreConfig(_Section):
    url: str = Field("", description="SQLAlchemy-style URL; empty: SQLite at <data_dir>/jobs.db")
    data_dir: Path = Path("dit-serve-data")
    lease_seconds: float = Field(30.0, gt=0, description="a leased item returns to the queue this long "
                                                         "after its scheduler stops renewing it")
    max_requeues: int = Field(50, ge=1, description="infrastructure failures (a worker or node died, a lease "
                                                    "expired) an item survives before it is marked failed")
    poison_crashes: int = Field(2, ge=1, description="times an item may crash its worker while running alone "
                                                     "before it is marked failed as the cause")
    retention_hours: float = Field(0.0, ge=0, description="delete finished jobs (rows and images) this long "
                                                         "after their last item ended; 0 keeps them")
    upload_retention_hours: float = Field(24.0, ge=0, description="delete uploads (POST /v1/uploads) this long "
                                                                 "after they were made; 0 keeps them until "
                                                                 "deleted (a job keeps its own copy of its "
                                                                 "inputs, deleted with the job)")

    def database_url(self) -> str:
        return self.url or f"sqlite:///{self.data_dir / 'jobs.db'}"


class RayConfig(_Section):
    address: str = Field("", description="empty: start a local Ray instance")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray instance (default: all)")
    namespace: str = "dit-serve"
    log_to_driver: bool = False


class LimitsConfig(_Section):
    max_items_per_job: int = Field(10000, ge=1)
    max_steps: int = Field(1000, ge=1)
    max_images_per_request: int = Field(10, ge=1, description="`n` of the OpenAI images endpoint")
    generation_timeout_s: float = Field(600.0, gt=0, description="how long the images endpoint waits")
    max_queued_items: int = Field(100_000, ge=1, description="items queued or running over all tenants; a job "
                                                             "beyond it gets a 429 with Retry-After")
    tenant_max_queued_items: int = Field(20_000, ge=1, description="the same per tenant, unless the tenant "
                                                                   "has its own limit (dit-serve keys create)")
    reserve_fraction: float = Field(0.1, ge=0, lt=1, description="the last part of max_queued_items kept for "
                                                                  "tenants that hold little: a job that would take "
                                                                  "the queue into it is admitted only if its tenant "
                                                                  "then holds at most that many items, so no tenant "
                                                                  "(an admin's included) fills the queue for the others")
    tenant_max_priority: int = Field(100, ge=-100, le=100, description="highest job priority a tenant may "
                                                                       "ask for, unless it has its own limit")
    max_image_bytes: int = Field(20 << 20, ge=1024, le=1 << 30,
                                 description="an edit's input image or mask file (POST /v1/uploads, "
                                             "/v1/images/edits); larger: 413 naming the field")
    max_inline_image_bytes: int = Field(4 << 20, ge=1024, le=1 << 30,
                                        description="an image or mask sent inline in POST /v1/jobs (base64 or a "
                                                    "data URL), decoded; larger: 413 naming the field (upload it)")
    tenant_max_upload_bytes: int = Field(1 << 30, ge=1024, description="the uploads a tenant may keep at once, "
                                                                       "in bytes; past it: 403 (delete uploads, or "
                                                                       "retention deletes them)")

    @property
    def reserved_items(self) -> int:
        """The reserve of ``reserve_fraction``, in items."""
        return int(self.max_queued_items * self.reserve_fraction)


class WebhookConfig(_Section):
    secret: SecretStr | None = Field(None, description="when set, each delivery carries X-Dit-Serve-Signature: "
                                                       "sha256=<HMAC-SHA256 of the body with this secret>")
    timeout_s: float = Field(10.0, gt=0, description="how long one delivery may take")
    max_attempts: int = Field(8, ge=1, description="deliveries tried before a webhook is marked failed")
    backoff_s: float = Field(2.0, gt=0, description="wait before the first retry; doubles each time (max 10 min)")
    allow_hosts: tuple[str, ...] = Field((), description="destinations allowed although they are loopback, "
                                         "private, link-local or multicast: host names, addresses or networks "
                                         "('10.0.0.0/8'); everything else of that kind is refused")


    @field_validator("allow_hosts")
    @classmethod
    def _allow_hosts(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        from dit_serve.server.netguard import Allowlist

        Allowlist.parse(entries)  # a bad entry is a config error now, not a failed delivery later
        return entries


class SchedulerConfig(_Section):
    tick_seconds: float = Field(0.05, gt=0)
    heartbeat_seconds: float = Field(0.5, gt=0, description="progress writes, lease renewals, cancel checks")
    reconcile_seconds: float = Field(2.0, gt=0, description="how often the cluster's nodes are checked")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, how long running items may take to "
                                                         "finish before they go back to the queue")
    group_shapes: bool = Field(True, description="lease items of the sizes a worker runs now before others of "
                                                 "the same priority (the queue's head always first): fewer, "
                                                 "fuller graph replays under mixed-size traffic; false: "
                                                 "strict queue order")


LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?")  # Ray's (Kubernetes') label syntax


class ModelPlacement(_Section):
    """Where a model's workers may run (``[autoscale.placement]``): nodes with these Ray labels, taking these
    custom resources of them. A worker holding the model starts only on such a node and reserves the resources;
    an idle worker elsewhere is never switched to it; Ray's autoscaler is asked for bundles that carry both."""

    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels its node must carry, e.g. "
                                   "{gpu = \"h100\"} (`ray start --labels`, a KubeRay group's rayStartParams)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources its worker takes of its "
                                        "node, e.g. {\"accelerator_type:H100\" = 0.001} (Ray's own per-node "
                                        "resource) or one a node type declares")

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not LABEL_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a Ray label key (letters, digits, '-', '_', '.', an optional "
                                 "'prefix/')")
            if not LABEL_VALUE.fullmatch(value):
                raise ValueError(f"{key} = {value!r}: a label value is letters, digits, '-', '_' and '.', at most "
                                 "63 (operators such as in(...) are not taken: name one value)")
        return labels

    @field_validator("resources")
    @classmethod
    def _resources(cls, table: dict[str, float]) -> dict[str, float]:
        for name, value in table.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r}: pin a model by a custom resource or a label; a worker's {name} is "
                                 "[autoscale] bundle's")
            if not value > 0:
                raise ValueError(f"{name!r} = {value}: must be more than 0")
        return table


class AutoscaleConfig(_Section):
    """How many workers run, and which models each holds (``dit_serve.server.autoscale``). Off by default: one
    worker per GPU (or the CPU workers), each with every configured model, as the cluster gives them."""

    enabled: bool = Field(False, description="start and stop workers by the backlog, and ask Ray's autoscaler "
                                             "for the nodes they need")
    min_workers: int = Field(0, ge=0, description="workers kept running with no backlog; 0: scale to zero")
    max_workers: int = Field(8, ge=1, description="most workers at once (Ray is never asked for more)")
    min_workers_per_model: dict[str, int] = Field(default_factory=dict, description="per model, workers kept "
                                                  "serving it with no backlog")
    max_workers_per_model: dict[str, int] = Field(default_factory=dict, description="per model, most workers "
                                                  "serving it at once")
    target_drain_s: float = Field(300.0, gt=0, description="enough workers to finish the backlog in about this "
                                                           "long: workers = ceil(steps left / (rate x this))")
    idle_timeout_s: float = Field(300.0, ge=0, description="a worker with nothing leased and no backlog for its "
                                                          "models stops after this long (above the minimums)")
    default_rate: float = Field(100.0, gt=0, description="denoising steps of one image per second that one worker "
                                                         "does, until measured, for models without a `rates` entry "
                                                         "or an estimate from their card (GPU workers: "
                                                         "workers/families/rates.py)")
    rates: dict[str, float] = Field(default_factory=dict, description="per model, the rate until measured "
                                    "(image-steps per second per worker), over its card's estimate")
    start_cost_s: float = Field(120.0, ge=0, description="a new worker's start (a node, the process, its first "
                                                        "model), until measured")
    switch_cost_s: float = Field(30.0, ge=0, description="an idle worker's switch to another model (unload, "
                                                        "load, warm), until measured")
    min_switch_gain_s: float = Field(0.0, ge=0, description="switch an idle worker to a model only if that "
                                                           "finishes the model's backlog at least this much sooner")
    memory_gib: float = Field(0.0, ge=0, description="device memory of one worker, for placement: a new worker "
                                                     "also loads the other models with backlog whose weights "
                                                     "fit (workers/families/memory.py); 0: one model per worker")
    request_resources: bool = Field(True, description="ask Ray's autoscaler for the workers' nodes "
                                                      "(ray.autoscaler.sdk.request_resources); false: use the "
                                                      "nodes the cluster has")
    bundle: dict[str, float] = Field(default_factory=dict, description="what one worker asks Ray for; empty: one "
                                     "unit of [workers] resource (GPU when it is auto), or its num_cpus CPUs")
    placement: dict[str, ModelPlacement] = Field(default_factory=dict, description="per model, the nodes its "
                                                 "workers may run on (labels, custom resources); unnamed models "
                                                 "run anywhere. Honoured with autoscaling off too")

    @field_validator("min_workers_per_model")
    @classmethod
    def _at_least_zero(cls, table: dict[str, int]) -> dict[str, int]:
        for name, value in table.items():
            if value < 0:
                raise ValueError(f"{name!r} = {value}: must be 0 or more")
        return table

    @field_validator("max_workers_per_model", "rates", "bundle")
    @classmethod
    def _positive(cls, table: dict) -> dict:
        for name, value in table.items():
            if not value > 0:
                raise ValueError(f"{name!r} = {value}: must be more than 0")
        return table

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscaleConfig":
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) is more than max_workers ({self.max_workers})")
        for model, low in self.min_workers_per_model.items():
            high = min(self.max_workers_per_model.get(model, self.max_workers), self.max_workers)
            if low > high:
                raise ValueError(f"min_workers_per_model[{model!r}] ({low}) is more than that model may have ({high})")
        if (low := sum(self.min_workers_per_model.values())) > self.max_workers:
            raise ValueError(f"min_workers_per_model adds up to {low}, more than max_workers ({self.max_workers})")
        return self

    def worker_bundle(self, workers: WorkerConfig) -> dict[str, float]:
        """What one worker takes of a node, as Ray's autoscaler is asked for it."""
        if self.bundle:
            return dict(self.bundle)
        resource = "GPU" if workers.resource == "auto" else workers.resource
        return {"CPU": workers.num_cpus} if resource == "CPU" else {resource: 1.0}


class Config(_Section):
    server: ServerConfig = ServerConfig()
    store: StoreConfig = StoreConfig()
    ray: RayConfig = RayConfig()
    workers: WorkerConfig = WorkerConfig()
    limits: LimitsConfig = LimitsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    webhooks: WebhookConfig = WebhookConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()

    @model_validator(mode="after")
    def _autoscale_models(self) -> "Config":
        a = self.autoscale
        for table in ("min_workers_per_model", "max_workers_per_model", "rates", "placement"):
            if unknown := sorted(set(getattr(a, table)) - set(self.workers.models)):
                raise ValueError(f"autoscale.{table} names {', '.join(map(repr, unknown))}, not among the served "
                                 f"models ({', '.join(self.workers.models)})")
        if a.placement and self.workers.resource == "CPU":
            raise ValueError("autoscale.placement pins models to nodes, and CPU workers are not placed on nodes (Ray "
                             "places them): name the nodes' resource as [workers] resource, or drop the pins")
        return self

    def worker_config(self) -> WorkerConfig:
        """The workers' section as the workers get it: their compiled kernels kept under the data directory
        unless it names another place, so a restarted service starts from a warm cache (Inductor's kernels
        and FlashAttention-4's)."""
        if self.workers.compile_cache:
            return self.workers
        cache = str(Path(self.store.data_dir).resolve() / "compile-cache")
        return self.workers.model_copy(update={"compile_cache": cache})

    def with_overrides(self, **sections: dict) -> "Config":
        """A copy with some fields replaced, e.g. ``with_overrides(server={"port": 0})``; validated."""
        data = self.model_dump()
        for name, fields in sections.items():
            data[name].update({k: v for k, v in fields.items() if v is not None})
        return _validate(data, "the command line or environment")


def load_config(path: Path | None = None) -> Config:
    """The config in ``path`` (TOML), or the defaults when ``path`` is None."""
    if path is None:
        return Config()
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    return _validate(data, str(path))


def _validate(data: dict, source: str) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"{p}: " if i == len(err["loc"]) - 1 else f"{p}." for i, p in enumerate(err["loc"]))
        raise ConfigError(f"{source}: {where}{err['msg'].removeprefix('Value error, ')}") from None

