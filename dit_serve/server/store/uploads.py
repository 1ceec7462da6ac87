"""Edits' input files: uploads (``POST /v1/uploads``: a row each, the file ``uploads/<id>`` under the data dir,
counted in its tenant's quota, deleted by retention) and a job's own copy of its inputs (``inputs/<job>/image``,
an instruction edit's further references ``inputs/<job>/image2``, ``image3``, ..., and ``inputs/<job>/mask``:
written once per job by ``JobsMixin.submit``, staged before its transaction and
renamed into place inside it, read when its items are leased, deleted with the job).

The bytes are only ever stored, hashed and handed to Pillow's PNG, JPEG and WebP decoders
(``workers.request.images``): never executed, never unpickled."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from sqlalchemy import bindparam, func, select, text

from dit_serve.schemas import INPUT_NAME, JobParams, Upload, input_name
from dit_serve.server.store.base import StoreBase
from dit_serve.server.store.tables import uploads


class UploadQuotaFull(RuntimeError):
    """An upload that would take its tenant's uploads past their bound: nothing was stored."""


class InputMissing(ValueError):
    """A job's stored input that cannot be read back (gone from the data dir, or changed)."""


class UploadsMixin(StoreBase):
    """Uploads, and the inputs jobs keep."""

    def put_upload(self, tenant: str, data: bytes, fmt: str, width: int, height: int, filename: str | None = None,
                   max_tenant_bytes: int | None = None, ttl_s: float = 0.0) -> Upload:
        """Store an uploaded image (already checked by the caller) for ``tenant``; ``UploadQuotaFull``, and
        nothing stored, when its uploads would then hold more than ``max_tenant_bytes``. ``ttl_s`` > 0: retention
        deletes it that long after now."""
        now = time.time()
        row = dict(id="upl_" + secrets.token_hex(12), tenant=tenant, sha256=hashlib.sha256(data).hexdigest(),
                   bytes=len(data), format=fmt, width=width, height=height,
                   filename=filename[:200] if filename else None, created_at=now,
                   expires_at=now + ttl_s if ttl_s > 0 else None)
        final = self.data_dir / "uploads" / row["id"]
        tmp = _stage(final, data)
        try:
            with self._tx() as conn:
                if conn.dialect.name == "postgresql":  # concurrent uploads of a tenant cannot pass the bound together
                    conn.execute(text("SELECT pg_advisory_xact_lock(7346120986)"))
                if max_tenant_bytes is not None:
                    held = int(conn.execute(_HELD, {"tenant": tenant, "now": now}).scalar_one())  # PG: numeric
                    if held + len(data) > max_tenant_bytes:
                        raise UploadQuotaFull(f"your tenant's uploads hold {held:,} bytes and may hold at most "
                                              f"{max_tenant_bytes:,}; this file of {len(data):,} would pass that: "
                                              "delete uploads you no longer need (DELETE /v1/uploads/{id}) or "
                                              "send the image inline")
                conn.execute(uploads.insert(), row)
                os.replace(tmp, final)  # before the commit, so that a committed row always has its file
        except BaseException:
            final.unlink(missing_ok=True)  # a commit that failed: no row names it
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return _upload(row)

    def get_upload(self, upload_id: str, tenant: str | None = None, data: bool = False
                   ) -> tuple[Upload, bytes | None] | None:
        """(the upload, its bytes when ``data``), or None: no such upload, another tenant's (``tenant`` given), or
        one past its expiry (retention deletes it soon)."""
        query = select(uploads).where(uploads.c.id == upload_id)
        if tenant is not None:
            query = query.where(uploads.c.tenant == tenant)
        with self._tx(write=False) as conn:
            row = conn.execute(query).first()
        if row is None or (row.expires_at is not None and row.expires_at <= time.time()):
            return None
        if not data:
            return _upload(row._mapping), None
        try:
            return _upload(row._mapping), (self.data_dir / "uploads" / upload_id).read_bytes()
        except FileNotFoundError:  # deleted meanwhile
            return None

    def delete_upload(self, upload_id: str, tenant: str | None = None) -> bool:
        """Delete an upload (jobs that used it keep their own copy); False when there is none (or another
        tenant's)."""
        query = uploads.delete().where(uploads.c.id == upload_id)
        if tenant is not None:
            query = query.where(uploads.c.tenant == tenant)
        with self._tx() as conn:
            gone = conn.execute(query).rowcount == 1
        if gone:
            (self.data_dir / "uploads" / upload_id).unlink(missing_ok=True)
        return gone

    def upload_bytes(self, tenant: str) -> int:
        """What ``tenant``'s uploads hold (those not past their expiry), in bytes."""
        with self._tx(write=False) as conn:
            return int(conn.execute(_HELD, {"tenant": tenant, "now": time.time()}).scalar_one())

    def purge_uploads(self, limit: int = 500) -> list[str]:
        """Delete up to ``limit`` uploads past their expiry (retention); returns their ids."""
        if not self._any(select(uploads.c.id).where(uploads.c.expires_at <= time.time()).limit(1)):
            return []  # a read, no write lock, when there is nothing to do
        with self._tx() as conn:
            ids = conn.execute(select(uploads.c.id).where(uploads.c.expires_at <= time.time())
                               .order_by(uploads.c.expires_at).limit(limit)).scalars().all()
            if ids:
                conn.execute(uploads.delete().where(uploads.c.id.in_(ids)))
        for upload_id in ids:  # after the commit: a crash leaves a file no row names, which the sweep removes
            (self.data_dir / "uploads" / upload_id).unlink(missing_ok=True)
        return list(ids)

    # -- a job's own inputs -------------------------------------------------------------------------
    def job_input(self, job_id: str, name: str) -> bytes | None:
        """A job's stored input (``image``, ``image2``, ... or ``mask``), or None when it has none. The caller
        checks the job is the caller's."""
        if not re.match(INPUT_NAME, name):
            return None
        try:
            return (self.data_dir / "inputs" / job_id / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _stage_inputs(self, job_id: str, inputs: dict[str, bytes]) -> Path:
        """Write a new job's inputs (fsynced) into a staging folder, ``inputs/.staging-<job>``, which the
        submitting transaction renames to ``inputs/<job>`` before it commits; returns the folder."""
        staging = self.data_dir / "inputs" / f".staging-{job_id}"
        try:
            for name, data in inputs.items():
                if not re.match(INPUT_NAME, name):
                    raise ValueError(f"unknown job input {name!r}")
                os.replace(_stage(staging / name, data), staging / name)
        except BaseException:
            self._drop_inputs(job_id)
            raise
        return staging

    def _place_inputs(self, job_id: str, staging: Path) -> None:
        os.replace(staging, self.data_dir / "inputs" / job_id)

    def _drop_inputs(self, job_id: str) -> None:
        """Remove a job's inputs, staged or placed (a submission that was refused, replayed or failed)."""
        for folder in (f".staging-{job_id}", job_id):
            shutil.rmtree(self.data_dir / "inputs" / folder, ignore_errors=True)


def _stage(final: Path, data: bytes) -> str:
    """``data`` in a fsynced temp file beside ``final`` (in its folder, made if needed); returns its path."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def read_inputs(data_dir: Path, job_id: str, params: JobParams) -> tuple[bytes, tuple[bytes, ...], bytes]:
    """(image, the further reference images, mask) bytes of a job with an edit's inputs, checked against their
    stored SHA-256 (b"" where the job has none); ``InputMissing`` when one is gone or changed."""
    def read(name: str, ref) -> bytes:
        return b"" if ref is None else _read_input(str(data_dir / "inputs" / job_id / name), ref.sha256)

    extra = tuple(read(input_name(i), ref) for i, ref in enumerate(params.extra_images, 1))
    return read("image", params.image), extra, read("mask", params.mask)


@functools.lru_cache(maxsize=16)  # a job's items are leased a few at a time: its inputs are read once, and the
def _read_input(path: str, sha256: str) -> bytes:  # specs of one lease share the bytes (pickled once to a worker)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputMissing(f"its input {Path(path).name} cannot be read from the data directory ({e.strerror or e}; "
                           "a multi-host deployment needs the data directory on shared storage)") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise InputMissing(f"its stored input {Path(path).name} changed since it was submitted (SHA-256 differs)")
    return data


def _upload(row) -> Upload:
    return Upload(id=row["id"], sha256=row["sha256"], bytes=row["bytes"], format=row["format"], width=row["width"],
                  height=row["height"], filename=row["filename"], created_at=row["created_at"],
                  expires_at=row["expires_at"])


_HELD = select(func.coalesce(func.sum(uploads.c.bytes), 0)).where(
    uploads.c.tenant == bindparam("tenant"),
    (uploads.c.expires_at.is_(None)) | (uploads.c.expires_at > bindparam("now")))
