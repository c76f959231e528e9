"""Everything about policy *versions*, one sub-package per subsystem, in data-flow order.

- :mod:`policies.wire` — the contracts both sides of a boundary speak: the request lane, the
  batch protocol, tool-call parsing, chat-token bookkeeping, log set-up, the ``SprawlError``
  root. Torch-free; it imports nothing else of sprawl.
- :mod:`policies.codec` — served views (bf16, fp8, int4, nvfp4) and the bitwise patch codec.
- :mod:`policies.model` — sprawl's own tiny model and tokenizer, built offline.
- :mod:`policies.board` — immutable versions and a monotonic pointer on any fsspec URL.
- :mod:`policies.serve` — the reference engine, the sidecar that makes any engine
  version-aware, the lane's HTTP server, and the backends (reference, vLLM, SGLang, OpenAI).
- :mod:`policies.train` — the reference trainer, its config, and the SFT warm start.

:mod:`policies.errors` is this package's error tree. Imports only run down this list (a test
checks it), and nothing here imports :mod:`orchestrator`.
"""
