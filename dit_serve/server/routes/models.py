"""The served models: ``GET /v1/models`` and one model's card."""

from __future__ import annotations

from fastapi import Path

from dit_serve.schemas import ModelCard, ModelList, clip
from dit_serve.server.catalog import RequestError
from dit_serve.server.routes import errors
from dit_serve.server.routes.deps import CatalogDep, v1_router

router = v1_router("models")


@router.get("/models", response_model=ModelList)
def list_models(catalog: CatalogDep) -> ModelList:
    return ModelList(data=[catalog.entry(name) for name in catalog.models])


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=errors(404))
def get_model(catalog: CatalogDep, model_id: str = Path(max_length=200)) -> ModelCard:
    if model_id not in catalog.models:
        raise RequestError(f"no model {clip(model_id, 80)!r}; this service serves: "
                           f"{', '.join(catalog.models)}", "model", status=404)
    return catalog.entry(model_id)
