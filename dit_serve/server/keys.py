"""Tenants and their API keys.

A key reads ``dsk_<id>_<secret>``. The store keeps the id, the tenant, the role and
HMAC-SHA256(salt, secret) with a random salt per key, never the key itself: a copy of the database
does not let anyone in. Keys are made and revoked with ``dit-serve keys create|list|revoke``; the
new key is printed once. Keys in ``[server] api_keys`` (or ``DIT_SERVE_API_KEY``) still work: they act as
the admin of the tenant ``default``, for a single-tenant deployment.

A tenant sees and acts on its own jobs only; an ``admin`` key sees every tenant's. Each tenant has
limits (queued items, highest priority) that fall back to ``[limits]``. A service with no key at all
(neither configured nor stored) is open, and every caller is the admin of ``default``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select, update

from dit_serve.server.store import DEFAULT_TENANT, Store, api_keys, tenants

ROLES = ("user", "admin")
TENANT_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
_KEY = re.compile(r"^dsk_([0-9a-f]{12})_([0-9A-Za-z_-]{20,100})$")


class AuthError(Exception):
    """A missing, malformed, unknown or revoked key."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, as a user or an admin, and that tenant's own limits (None: the defaults)."""

    tenant: str = DEFAULT_TENANT
    admin: bool = True
    max_queued: int | None = None
    max_priority: int | None = None

    @property
    def scope(self) -> str | None:
        """The tenant the caller's store queries are restricted to (None: every tenant)."""
        return None if self.admin else self.tenant


def _digest(salt: str, secret: str) -> str:
    return hmac.new(salt.encode(), secret.encode(), hashlib.sha256).hexdigest()


def create_key(store: Store, tenant: str, role: str = "user", name: str | None = None) -> tuple[str, str]:
    """A new key for ``tenant`` (created if new); returns (key id, the key). The key is not stored."""
    if not re.match(TENANT_PATTERN, tenant):
        raise ValueError(f"a tenant name is 1-64 characters of a-z, 0-9, '_', '.', '-', not {tenant[:80]!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    key_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_hex(16)
    with store._tx() as conn:
        if conn.execute(select(tenants.c.name).where(tenants.c.name == tenant)).first() is None:
            conn.execute(tenants.insert().values(name=tenant, created_at=time.time()))
        conn.execute(api_keys.insert().values(id=key_id, tenant=tenant, role=role, salt=salt,
                                              hash=_digest(salt, secret), name=name, created_at=time.time()))
    return key_id, f"dsk_{key_id}_{secret}"


def set_limits(store: Store, tenant: str, max_queued: int | None, max_priority: int | None) -> bool:
    """Set a tenant's own limits (None leaves one as it is); False for an unknown tenant."""
    values = {k: v for k, v in (("max_queued", max_queued), ("max_priority", max_priority)) if v is not None}
    with store._tx() as conn:
        if conn.execute(select(tenants.c.name).where(tenants.c.name == tenant)).first() is None:
            return False
        if values:
            conn.execute(update(tenants).where(tenants.c.name == tenant).values(**values))
    return True


def list_keys(store: Store) -> list[dict]:
    """Every key (never its secret), oldest first, with its tenant's limits."""
    with store._tx(write=False) as conn:
        rows = conn.execute(select(api_keys.c.id, api_keys.c.tenant, api_keys.c.role, api_keys.c.name,
                                   api_keys.c.created_at, api_keys.c.revoked_at, tenants.c.max_queued,
                                   tenants.c.max_priority)
                            .join(tenants, tenants.c.name == api_keys.c.tenant)
                            .order_by(api_keys.c.created_at)).mappings().all()
    return [dict(r) for r in rows]


def revoke_key(store: Store, key_id: str) -> bool:
    """Revoke a key (it stops working within a few seconds); False if there is no such active key."""
    with store._tx() as conn:
        return conn.execute(update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                            .values(revoked_at=time.time())).rowcount == 1


class KeyRing:
    """Authenticates bearer tokens against the configured keys and the stored ones. Stored keys are
    looked up by id and their secret checked in constant time; answers are cached for ``cache_s``
    seconds (so a revoked key stops working within that long)."""

    def __init__(self, store: Store, config_keys: list[str], cache_s: float = 2.0):
        self.store, self.cache_s = store, cache_s
        self._config = [k.encode() for k in config_keys]
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._any_stored: tuple[float, bool] = (0.0, False)

    def required(self) -> bool:
        """Whether callers need a key: some are configured, or the store holds an active one."""
        return self._required(read=True)

    def _required(self, read: bool) -> bool | None:
        if self._config:
            return True
        now = time.monotonic()
        if now - self._any_stored[0] > self.cache_s:
            if not read:
                return None
            with self.store._tx(write=False) as conn:
                found = conn.execute(select(api_keys.c.id).where(api_keys.c.revoked_at.is_(None)).limit(1)).first()
            self._any_stored = (now, found is not None)
        return self._any_stored[1]

    def authenticate(self, token: str | None) -> Principal:
        return self._answer(token, read=True)

    def answer_now(self, token: str | None) -> Principal | None:
        """``authenticate``'s answer when it needs no store read (configured keys, answers cached), else
        None: the caller then calls ``authenticate`` off its event loop."""
        return self._answer(token, read=False)

    def _answer(self, token: str | None, read: bool) -> Principal | None:
        required = self._required(read)
        if required is None:
            return None
        if not required:
            return Principal()
        if not token:
            raise AuthError("this service needs an API key: send 'Authorization: Bearer <key>'")
        given = token.encode()
        if sum(hmac.compare_digest(given, k) for k in self._config):  # every key compared: constant time
            return Principal()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(token)
        if hit is None or now - hit[0] > self.cache_s:
            if not read:
                return None
            hit = (now, self._lookup(token))
            with self._lock:
                if len(self._cache) > 10_000:  # many wrong keys: forget them rather than grow
                    self._cache.clear()
                self._cache[token] = hit
        if hit[1] is None:
            raise AuthError("invalid API key")
        return hit[1]

    def _lookup(self, token: str) -> Principal | None:
        m = _KEY.match(token)
        if m is None:
            return None
        with self.store._tx(write=False) as conn:
            row = conn.execute(select(api_keys, tenants.c.max_queued, tenants.c.max_priority)
                               .join(tenants, tenants.c.name == api_keys.c.tenant)
                               .where(api_keys.c.id == m.group(1))).first()
        if row is None or row.revoked_at is not None:
            return None
        if not hmac.compare_digest(_digest(row.salt, m.group(2)), row.hash):
            return None
        return Principal(row.tenant, row.role == "admin", row.max_queued, row.max_priority)
