"""The workers each scheduler runs, as it last wrote them: which models each serves and loads, and how many
items it holds. Written by the scheduler when they change (and every few seconds, so that a reader can tell a
live scheduler's rows from a dead one's), read by any API process: the web page's list of workers, and a
job's note that it waits for a worker while none serves its model."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from sqlalchemy import delete, select

from dit_serve.server.store.base import StoreBase
from dit_serve.server.store.tables import workers

# rows of a scheduler that has not written for this long are not shown: it is gone (it writes every few seconds)
FRESH_S = 30.0


@dataclass(frozen=True)
class WorkerRow:
    key: str
    state: str  # starting | ready | switching
    models: list[str] = field(default_factory=list)   # what it serves now
    loading: list[str] = field(default_factory=list)  # what it loads (a starting worker: its models)
    node: str | None = None
    resource: str | None = None
    held: int = 0
    started_at: float = 0.0
    owner: str = ""
    updated_at: float = 0.0

    def same(self, other: "WorkerRow") -> bool:
        """Equal but for what changes all the time (items held, when written)."""
        skip = ("held", "updated_at")
        return {k: v for k, v in asdict(self).items() if k not in skip} == \
            {k: v for k, v in asdict(other).items() if k not in skip}


class WorkersMixin(StoreBase):
    """Each scheduler's workers: replaced whole by their scheduler, read by anyone."""

    def put_workers(self, owner: str, rows: list[WorkerRow]) -> None:
        """``owner``'s workers are ``rows`` now (none: it stopped)."""
        now = time.time()
        with self._tx() as conn:
            conn.execute(delete(workers).where(workers.c.owner == owner))
            if rows:
                conn.execute(workers.insert(), [dict(owner=owner, key=r.key, state=r.state, models=json.dumps(r.models),
                                                     loading=json.dumps(r.loading), node=r.node, resource=r.resource,
                                                     held=r.held, started_at=r.started_at, updated_at=now)
                                                for r in rows])

    def list_workers(self, fresh_s: float = FRESH_S) -> list[WorkerRow]:
        """The workers of the schedulers that wrote within ``fresh_s``, oldest first."""
        with self._tx(write=False) as conn:
            rows = conn.execute(select(workers).where(workers.c.updated_at >= time.time() - fresh_s)
                                .order_by(workers.c.started_at, workers.c.owner, workers.c.key)).all()
        return [WorkerRow(key=r.key, state=r.state, models=json.loads(r.models), loading=json.loads(r.loading),
                          node=r.node, resource=r.resource, held=r.held, started_at=r.started_at, owner=r.owner,
                          updated_at=r.updated_at) for r in rows]

    def waiting_note(self, model: str, fresh_s: float = FRESH_S) -> str | None:
        """Why queued items of ``model`` wait: no worker serves it (None when one does)."""
        rows = self.list_workers(fresh_s)
        if any(model in r.models for r in rows):
            return None
        if any(model in r.loading for r in rows):
            return f"waiting for a worker: one is loading model {model!r}"
        return f"waiting for a worker: none serves model {model!r} now"
