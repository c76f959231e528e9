"""Backends that put an external engine (vLLM, SGLang, an OpenAI-compatible server) behind the
sprawl sidecar; see :mod:`policies.serve.backends.base` for what every adapter guarantees and
``docs/fleet.md`` for the engine versions they were written against."""
