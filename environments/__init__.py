"""Environments: the ``Environment`` base class users subclass, and four example environments.

See docs/environments.md. ``base`` (the class), ``tools`` (schemas and calls), ``tasks`` (task
sources), ``types`` (configs, state, replies), ``loader`` (import path → instance), ``scripted``
(play an environment with fixed assistant texts), ``verifiers_adapter`` (verifiers 0.4 environments,
``kind = "verifiers"``, with ``verifiers_trace``: a verifiers episode read as sprawl's);
examples: ``calculator``, ``coding``, ``guess``, ``retrieval``.
Importing this package imports nothing heavy.
"""
