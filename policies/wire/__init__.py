"""The wire: what both sides of every boundary speak, at the bottom of the import graph.

- :mod:`~policies.wire.lane` — the request lane's pydantic models (orchestrator ↔ endpoint);
- :mod:`~policies.wire.batches` — the batch protocol (orchestrator ↔ external trainer);
- :mod:`~policies.wire.toolcalls` — sprawl's (Hermes) chat template and the parsed-turn
  vocabulary (engine ↔ environment ↔ episode runner);
- :mod:`~policies.wire.tool_parsers` — one tool-call parser per model family, by vLLM name;
- :mod:`~policies.wire.chat_tokens` — token-exact multi-turn prompts, and ``Message``;
- :mod:`~policies.wire.logs` — structlog set-up for every process;
- :mod:`~policies.wire.lifetime` — a child process's lifetime tied to its parent's;
- :mod:`~policies.wire.errors` — ``SprawlError``, the root of every error tree.

Torch-free and free of sprawl imports outside this package, so an environment, a trainer or a
vLLM worker can import it anywhere.
"""
