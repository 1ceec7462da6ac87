"""The sections of bench/workload.py, a module per report: ``plain`` (workload_<model>), ``edits``
(edits_<model>) and ``lora`` (lora_<model>). Each holds its sections, their report's Markdown and what
workload.py needs to run them: ``REPORT`` (the report's prefix), ``NAMES`` (a section's name on the command line
-> its key in the report), ``DEFAULTS`` (options whose default is the group's own), ``SMOKE`` (--smoke's
settings), ``SMOKE_FAMILIES``, ``run(args) -> result`` and ``markdown(result)``. ``shared``: the requests,
pipelines and batching loops they share."""
