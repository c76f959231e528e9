"""Staleness: lag accounting, lag corrections and their metrics, as pure functions.

Modules, in data-flow order:

- :mod:`staleness.config` — the ``[staleness]`` config tree (no torch).
- :mod:`staleness.lag` — per-token / episode / group lag from version stamps, the drop rule
  (no torch).
- :mod:`staleness.corrections` — per-token weights and masks for ``none``, ``tis``, ``mis``,
  ``decoupled_ppo`` and ``token_mask``.
- :mod:`staleness.loss` — GRPO advantages, PPO-clip composed with a correction, KL terms.
- :mod:`staleness.metrics` — lag histogram, length-bias guard, IS statistics, ESS, mismatch.

This package file imports nothing, so ``import staleness.config`` stays torch-free.
"""
