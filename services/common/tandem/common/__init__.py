"""Code shared by every Tandem service: settings, ids, the worker registry,
the error hierarchy and logging. Light on purpose: no torch, no vLLM, no Ray."""
