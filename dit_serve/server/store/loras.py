"""Adapters (LoRA): a row each in ``loras`` and the file ``loras/<name>.safetensors`` under the data dir. Names are one
name space (workers register adapters by name); an adapter is its tenant's, or shared with every tenant. The bytes
are stored, hashed and handed to the workers' safetensors reader (``workers.lora.formats``): never unpickled."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from sqlalchemy import func, or_, select

from dit_serve.schemas import Lora
from dit_serve.server.store.base import StoreBase
from dit_serve.server.store.tables import loras
from dit_serve.server.store.uploads import _stage


class LoraNameTaken(ValueError):
    """A name another adapter has: nothing was stored."""


class LorasMixin(StoreBase):
    """The adapter registry."""

    def lora_path(self, name: str) -> Path:
        return self.data_dir / "loras" / f"{name}.safetensors"

    def put_lora(self, name: str, data: bytes, tenant: str, shared: bool, model: str, family: str, fmt: str,
                 rank: int, modules: int, source: str = "upload", replace: bool = False) -> Lora:
        """Register an adapter (already checked by the caller); ``LoraNameTaken`` when the name is another's
        (``replace``: a lora_dir adapter of that name is written over)."""
        row = dict(name=name, tenant=tenant, shared=shared, model=model, family=family, format=fmt, rank=rank,
                   modules=modules, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), source=source,
                   created_at=time.time())
        final = self.lora_path(name)
        tmp = _stage(final, data)
        try:
            with self._tx() as conn:
                old = conn.execute(select(loras.c.source).where(loras.c.name == name)).first()
                if old is not None and not (replace and old.source == source == "dir"):
                    raise LoraNameTaken(f"an adapter named {name!r} exists: pick another name (or delete it first, "
                                        "DELETE /v1/loras/{name})")
                if old is not None:
                    conn.execute(loras.delete().where(loras.c.name == name))
                conn.execute(loras.insert(), row)
                os.replace(tmp, final)  # before the commit: a committed row always has its file
        except BaseException:
            if not self._has_lora_row(name):
                final.unlink(missing_ok=True)
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return _lora(row)

    def _has_lora_row(self, name: str) -> bool:
        return self._any(select(loras.c.name).where(loras.c.name == name))

    def get_loras(self, names: list[str], tenant: str | None = None) -> dict[str, Lora]:
        """The adapters of ``names`` that ``tenant`` may use (its own and the shared; None: every adapter)."""
        if not names:
            return {}
        query = select(loras).where(loras.c.name.in_(sorted(set(names))))
        if tenant is not None:
            query = query.where(or_(loras.c.tenant == tenant, loras.c.shared.is_(True)))
        with self._tx(write=False) as conn:
            return {r.name: _lora(r._mapping) for r in conn.execute(query)}

    def list_loras(self, tenant: str | None = None) -> list[Lora]:
        """The adapters ``tenant`` may use, by name (None: all)."""
        query = select(loras).order_by(loras.c.name)
        if tenant is not None:
            query = query.where(or_(loras.c.tenant == tenant, loras.c.shared.is_(True)))
        with self._tx(write=False) as conn:
            return [_lora(r._mapping) for r in conn.execute(query)]

    def delete_lora(self, name: str, tenant: str | None = None) -> Lora | None:
        """Delete an adapter ``tenant`` registered (None: any); the deleted one, or None. Jobs that named it and
        have not run yet fail with the reason when leased; their records keep its name and hash."""
        query = select(loras).where(loras.c.name == name)
        if tenant is not None:
            query = query.where(loras.c.tenant == tenant)
        with self._tx() as conn:
            row = conn.execute(query).first()
            if row is None:
                return None
            conn.execute(loras.delete().where(loras.c.name == name))
        self.lora_path(name).unlink(missing_ok=True)
        return _lora(row._mapping)

    def lora_data(self, name: str) -> tuple[Lora, bytes] | None:
        """(an adapter, its file's bytes), or None when it is gone."""
        found = self.get_loras([name])
        if name not in found:
            return None
        try:
            return found[name], self.lora_path(name).read_bytes()
        except FileNotFoundError:
            return None

    def count_loras(self) -> int:
        with self._tx(write=False) as conn:
            return int(conn.execute(select(func.count()).select_from(loras)).scalar_one())


def _lora(row) -> Lora:
    return Lora(name=row["name"], model=row["model"], family=row["family"], format=row["format"], rank=row["rank"],
                modules=row["modules"], sha256=row["sha256"], bytes=row["bytes"], owner=row["tenant"],
                shared=bool(row["shared"]), source=row["source"], created_at=row["created_at"])
