"""The speed layer: ``workers.speed.apply.apply(model, family, config)`` turns a loaded model into the fast one
(graph-backend patches, routed attention, FP8, epilogues, fused norms, compile preparation); ``SpeedConfig``
(``workers.speed.config``, light to import) says which."""

from workers.speed.config import SpeedConfig

__all__ = ["SpeedConfig"]
