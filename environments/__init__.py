"""Environments: the ``Environment`` base class users subclass, and four example environments.

See docs/environments.md. ``base`` (the class), ``tools`` (schemas and calls), ``tasks`` (task
sources), ``types`` (configs, state, replies), ``loader`` (import path → instance), ``scripted``
(play an environment with fixed assistant texts), ``verifiers_adapter`` (verifiers environments,
``kind = "verifiers"``, with its model client ``verifiers_client`` and ``verifiers_rubric``);
examples: ``calculator``, ``coding``, ``guess``, ``retrieval``.
Importing this package imports nothing heavy.
"""
