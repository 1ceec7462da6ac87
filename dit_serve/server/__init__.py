"""The server side of dit-serve: the HTTP API, the store, the scheduler, the service that runs them,
and local generation. Installed with the ``server`` extra (``pip install "dit-serve[server]"``). The
SDK side (``dit_serve.client``, ``schemas``, ``outputs``, ``errors`` and the CLI's client commands)
imports nothing from here; the server side imports the SDK side's schemas."""
