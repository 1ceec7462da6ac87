"""Health and Prometheus metrics: no key, for probes and scrapers (they show counts, no job data)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from dit_serve.schemas import Health
from dit_serve.server.routes import errors
from dit_serve.server.routes.deps import MetricsDep, StoreDep, WorkersReadyDep

router = APIRouter(tags=["service"])


@router.get("/healthz", response_model=Health, responses=errors(503))
def health(store: StoreDep, workers_ready: WorkersReadyDep):
    try:
        counts = store.counts()
    except Exception as e:
        return JSONResponse({"status": "degraded", "queue_depth": -1, "detail": str(e)[:200]}, status_code=503)
    return Health(status="ok", queue_depth=counts.get("queued", 0), running=counts.get("running", 0),
                  workers=workers_ready())


@router.get("/metrics", response_class=Response)
def prometheus(store: StoreDep, metrics: MetricsDep) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    metrics.queue_depth.set(store.counts().get("queued", 0))
    metrics.loras_registered.set(store.count_loras())
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
