"""The path the families read the hoisted modulation from: ``workers.speed.modulation``.

``TABLES``: each request's modulation is made for all its steps at admission wherever the modulation is
hoisted; a constant, read by the families' ``table_specs``.
"""

from workers.speed.modulation import give, hoist_temb_modulation, restore_temb_modulation, temb_modulation

TABLES = True

__all__ = ["TABLES", "give", "hoist_temb_modulation", "restore_temb_modulation", "temb_modulation"]
