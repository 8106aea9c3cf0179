"""The gRPC KV connector: vLLM ``KVConnectorBase_V1`` loaded out of tree with
``kv_connector_module_path="tandem.worker.kv_connector.connector"``.

Pull mode, as vLLM's NIXL connector: the prefill engine keeps a finished
request's blocks and hands out a KV handle; the decode engine pulls them in
chunks over gRPC into its own paged cache and releases them; a lease frees
blocks nobody pulled.

Modules: ``params`` (the handle as it travels in ``kv_transfer_params``),
``layout`` (what a block looks like; refuse mismatches), ``metadata``
(scheduler → worker messages), ``scheduler_side`` (engine-core process),
``worker_side`` (model-runner process: KV server and puller),
``connector`` (the class vLLM instantiates)."""
