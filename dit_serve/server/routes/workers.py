"""The service's workers: ``GET /v1/workers``, as their schedulers last wrote them to the store (any API
process answers it): what each serves and loads, and how many items it holds."""

from __future__ import annotations

from dit_serve.schemas import WorkerList, WorkerStatus
from dit_serve.server.routes.deps import StoreDep, v1_router

router = v1_router("workers")


@router.get("/workers", response_model=WorkerList)
def list_workers(store: StoreDep) -> WorkerList:
    """Each worker: starting or ready, the models it serves and loads, the items it holds."""
    return WorkerList(data=[WorkerStatus(name=f"worker-{r.key}", state=r.state if r.state == "ready" else "starting",
                                         models=r.models, loading=r.loading, held=r.held, node=r.node,
                                         resource=r.resource, started_at=r.started_at)
                            for r in store.list_workers()])
