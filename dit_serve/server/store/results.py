"""Results and files: an item's PNG committed exactly once, and the previews beside the images (files,
no rows). Images are ``images/<job>/<index>.png`` under the data directory; previews
``previews/<job>/<index>.<step>.png``."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from sqlalchemy import bindparam, select, update

from dit_serve.server.store.base import NO_LEASE, StoreBase
from dit_serve.server.store.leases import HELD, Lease, held_params
from dit_serve.server.store.tables import items

_COMMIT_DONE = update(items).where(*HELD).values(state="done", step=items.c.total_steps, path=bindparam("path"),
                                                 finished_at=bindparam("finished_at"), **NO_LEASE)


class ResultsMixin(StoreBase):
    """Images and previews: written to files, the image's row updated under its lease."""

    def commit_result(self, lease: Lease, png: bytes) -> bool:
        """Record an item's PNG once; False (and nothing written) when the lease is no longer held.

        Exactly once: the PNG is written to a temporary file and fsynced; then, in one transaction, the item
        is marked done *only if* the caller still holds its lease (state running, same token), and the file
        is renamed to its final name ``images/<job>/<index>.png`` before the commit. A late or duplicate
        result finds no matching row and is dropped; a crash between rename and commit leaves a file that
        the item's re-run replaces with the same bytes (seeded generation is deterministic)."""
        rel = Path("images") / lease.job_id / f"{lease.index:05d}.png"
        final = self.data_dir / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{lease.index:05d}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(png)
                f.flush()
                os.fsync(f.fileno())
            with self._tx() as conn:
                won = conn.execute(_COMMIT_DONE, dict(held_params(lease), path=str(rel),
                                                      finished_at=time.time())).rowcount == 1
                if won:
                    os.replace(tmp, final)  # before commit: a failed commit leaves an orphan a re-run replaces
            if won:
                self._drop_preview(lease.job_id, lease.index)
                self.changes.notify([lease.job_id])
            return won
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def image_path(self, job_id: str, index: int, tenant: str | None = None) -> Path | None:
        query = select(items.c.path).where(items.c.job_id == job_id, items.c.idx == index)
        if tenant is not None:
            query = query.where(items.c.tenant == tenant)
        with self._tx(write=False) as conn:
            path = conn.execute(query).scalar()
        return self.data_dir / path if path else None

    # -- previews (ephemeral: files beside the images, no rows) --------------------------------------
    def put_preview(self, lease: Lease, step: int, png: bytes) -> None:
        """Keep ``png`` as the latest preview of a leased item (``previews/<job>/<index>.<step>.png``,
        renamed into place so readers on any process see a whole file; older steps removed after).
        No fsync and no row: a preview lost in a crash costs nothing. The step in the name lets event
        streams see a new preview from a directory listing."""
        folder = self.data_dir / "previews" / lease.job_id
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{lease.index:05d}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(png)
            os.replace(tmp, folder / f"{lease.index:05d}.{step:06d}.png")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in folder.glob(f"{lease.index:05d}.*.png"):
            if (key := _preview_key(old.name)) is not None and key < (lease.index, step):
                old.unlink(missing_ok=True)
        self.changes.notify([lease.job_id])

    def preview_steps(self, job_id: str) -> dict[int, int]:
        """Index -> step of the latest preview of each of the job's running items (the event streams' read:
        a listing, and a query only when the job has previews)."""
        latest: dict[int, int] = {}
        try:
            names = os.listdir(self.data_dir / "previews" / job_id)
        except FileNotFoundError:
            return latest
        for name in names:
            if (key := _preview_key(name)) is not None and key[1] > latest.get(key[0], -1):
                latest[key[0]] = key[1]
        if not latest:
            return latest
        with self._tx(write=False) as conn:
            running = set(conn.execute(select(items.c.idx).where(items.c.job_id == job_id,
                                                                 items.c.state == "running")).scalars())
        return {i: step for i, step in latest.items() if i in running}

    def preview(self, job_id: str, index: int, tenant: str | None = None) -> tuple[int, bytes] | None:
        """(step, PNG) of a running item's latest preview; None when it has none (or is not running)."""
        query = select(items.c.state).where(items.c.job_id == job_id, items.c.idx == index)
        if tenant is not None:
            query = query.where(items.c.tenant == tenant)
        with self._tx(write=False) as conn:
            if conn.execute(query).scalar() != "running":
                return None
        folder = self.data_dir / "previews" / job_id
        for _ in range(3):  # a newer preview may replace the one listed between listing and reading
            found = sorted(k for p in folder.glob(f"{index:05d}.*.png") if (k := _preview_key(p.name)))
            if not found:
                return None
            try:
                return found[-1][1], (folder / f"{index:05d}.{found[-1][1]:06d}.png").read_bytes()
            except FileNotFoundError:
                continue
        return None

    def _drop_preview(self, job_id: str, index: int) -> None:
        for p in (self.data_dir / "previews" / job_id).glob(f"{index:05d}.*.png"):
            p.unlink(missing_ok=True)


def _preview_key(name: str) -> tuple[int, int] | None:
    """(index, step) of a preview file's name ``<index>.<step>.png``; None for other files."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "png" or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])

