"""Serving: the reference engine, the sidecar that makes any engine version-aware, the lane.

Public surface (lazily imported): :class:`Engine`, :class:`DecodeBatcher`, :class:`Sidecar`,
:class:`LaneServer`, :class:`LaneLimits`, :func:`serve_board`, :func:`serve_model`,
:func:`run_lane`.

Modules: :mod:`~policies.serve.engine` (the reference engine: a transformers model, weights
patched in place), :mod:`~policies.serve.decode` (its continuous decode batcher; a request's rows
in :mod:`~policies.serve.decode_rows`, the batch's KV cache in :mod:`~policies.serve.kv_cache`),
:mod:`~policies.serve.sampling` (how a token is sampled and its log prob reported),
:mod:`~policies.serve.types` (a generation, quiesce modes, out-of-bounds refusals, the
:class:`~policies.serve.types.Backend` seam), :mod:`~policies.serve.sidecar` (stage → activate →
stamp, 409 outside the bounds; its metrics in :mod:`~policies.serve.sidecar_metrics`),
:mod:`~policies.serve.server` (the lane over aiohttp), :mod:`~policies.serve.reference_server`
(the reference engine on the lane, from a board or a model dir),
:mod:`~policies.serve.connections` (the lane's header, idle and body deadlines and connection
cap), :mod:`~policies.serve.http_body` (bearer tokens and JSON bodies read safely),
:mod:`~policies.serve.openai_routes` (chat and completions), :mod:`policies.serve.backends`
(reference, vLLM, SGLang, frozen OpenAI, and the standalone sidecar command).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
