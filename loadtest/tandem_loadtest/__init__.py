"""tandem-loadtest: load tests for OpenAI-compatible streaming endpoints.

Entry point: :mod:`tandem_loadtest.cli` (``tandem-loadtest run|compare|plot``).
The run is :func:`tandem_loadtest.runner.run_load`; metrics follow
``vllm bench serve`` (see :mod:`tandem_loadtest.metrics`).
"""

__version__ = "0.1.0"
