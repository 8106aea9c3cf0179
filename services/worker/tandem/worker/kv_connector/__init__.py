"""The gRPC KV connector: vLLM ``KVConnectorBase_V1`` loaded out of tree with
``kv_connector_module_path="tandem.worker.kv_connector.connector"``.

Pull mode, as vLLM's NIXL connector: the prefill engine keeps a finished
request's blocks and hands out a KV handle; the decode engine pulls them in
chunks over gRPC into its own paged cache and releases them; a lease frees
blocks nobody pulled.

Modules: ``params`` (the handle and a load's figures as they travel in
``kv_transfer_params``), ``layout`` (what a block looks like; refuse
mismatches), ``metadata`` (messages between the two halves each step),
``scheduler_side`` (engine-core process), ``worker_side`` (model-runner
process), which composes ``kv_server`` (the one owner of held blocks and
their leases) and ``puller`` (every pull), ``wire`` (the bytes on the wire),
``extension`` (what the worker service asks its KV server, through the
engine), ``connector`` (the class vLLM instantiates)."""
