"""Tandem worker: one program, two roles (prefill, decode), around vLLM's AsyncLLM.

Tree: ``service`` (gRPC tandem.v1.Worker, called by the gateway) → ``engine``
(AsyncLLM) → ``kv_connector`` (loaded by vLLM inside the engine's processes;
moves KV blocks between engines over gRPC tandem.v1.KVTransfer)."""
