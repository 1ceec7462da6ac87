"""Retention: what the store deletes on its own, finished jobs past ``[store] retention_hours`` (with their
images and inputs) and the temp files a killed process left behind. Uploads past their expiry:
``UploadsMixin.purge_uploads``."""

from __future__ import annotations

import shutil
import time

from sqlalchemy import and_, case, func, select

from dit_serve.server.store.base import StoreBase
from dit_serve.server.store.tables import items


class RetentionMixin(StoreBase):
    """Clean-up the service runs periodically."""

    def purge_finished(self, older_than_s: float, limit: int = 100) -> list[str]:
        """Delete up to ``limit`` jobs whose items all ended more than ``older_than_s`` seconds ago;
        returns their ids (the retention policy: ``[store] retention_hours``)."""
        cutoff = time.time() - older_than_s
        active = func.sum(case((items.c.state.in_(("queued", "running")), 1), else_=0))
        with self._tx(write=False) as conn:
            ids = conn.execute(select(items.c.job_id).group_by(items.c.job_id)
                               .having(and_(active == 0, func.max(items.c.finished_at) < cutoff))
                               .order_by(func.max(items.c.finished_at)).limit(limit)).scalars().all()
        return [job_id for job_id in ids if self.delete_job(job_id)]

    def sweep_temp_files(self, older_than_s: float = 600.0) -> int:
        """Delete result temp files a killed process left behind (written, never renamed nor removed);
        only old ones, since another scheduler may be writing a fresh one. Returns how many."""
        cutoff, n = time.time() - older_than_s, 0
        temps = [*(self.data_dir / "images").glob("*/.*.tmp"), *(self.data_dir / "previews").glob("*/.*.tmp"),
                 *(self.data_dir / "uploads").glob(".*.tmp"), *(self.data_dir / "loras").glob(".*.tmp")]
        for tmp in temps:
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    n += 1
            except FileNotFoundError:  # removed meanwhile
                pass
        for staging in (self.data_dir / "inputs").glob(".staging-*"):  # a submission killed before its commit
            try:
                if staging.stat().st_mtime < cutoff:
                    shutil.rmtree(staging, ignore_errors=True)
                    n += 1
            except FileNotFoundError:
                pass
        return n
