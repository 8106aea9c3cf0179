"""Tandem operator: reconciles ``TandemDeployment`` (tandem.dev/v1alpha1) into the
prefill and decode pools and scales each pool on its own signal.

Layers (handlers stay thin): :mod:`.handlers` (kopf) → :mod:`.reconcile`,
:mod:`.autoscale` (pure) → :mod:`.resources` (pure object builders);
:mod:`.kube` and :mod:`.signals` are the I/O boundaries.
"""
