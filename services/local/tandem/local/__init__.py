"""Local mode: the whole stack as child processes on one machine. Used by
``make run`` (``python -m tandem.local``) and by the integration tests."""
