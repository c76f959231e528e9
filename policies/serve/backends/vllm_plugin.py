"""The ``vllm.general_plugins`` entry point: registers sprawl's weight-transfer backend
(``"sprawl"``, :mod:`policies.serve.backends.vllm_transfer`) with vLLM.

vLLM loads general plugins in every process, early: a worker then scans every module loaded so
far for kernels to override (``register_triton_kernel_overrides``) and fails on some compiled
libraries' objects (llvmlite's, which the patch codec's kernels load). So this module imports
nothing of sprawl's and registers the backend by name; vLLM imports it only when an engine is
started with ``--weight-transfer-config '{"backend": "sprawl"}'``, after that scan.
"""

from __future__ import annotations

BACKEND = "sprawl"


def register() -> None:
    """Register the ``sprawl`` backend (once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "policies.serve.backends.vllm_transfer", "SprawlWeightTransferEngine"
        )
