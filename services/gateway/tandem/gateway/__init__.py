"""Tandem's edge gateway: the OpenAI-compatible HTTP/SSE front door.

Clients call it over HTTP; it calls the router (``Schedule``/``Release``) and
the workers (``Prefill``, ``Decode``, ``Abort``) over gRPC. Entry point:
``python -m tandem.gateway`` (see :mod:`tandem.gateway.__main__`); the app
factory is :func:`tandem.gateway.app.build_app`. Importing this package is
light: no transformers, no torch.
"""
