"""The request domain, torch-free: what the API, the store, the scheduler and the engine agree an image
request is.

- ``spec``: ``ItemSpec``, the one frozen description of an image, from the store to the engine;
- ``cards``: ``read_card``, a model's card read from its directory's own files (the families read them);
- ``admission``: which queued images start next (shape-aware);
- ``sizes``: requested sizes and how they map to the sizes a model makes;
- ``labels``: class labels by number or by name;
- ``images``: an edit request's uploaded image and mask, checked and decoded (Pillow).

Nothing here imports torch: the API process validates requests with it.
"""
