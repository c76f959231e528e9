"""Staleness: lag accounting, lag corrections and their metrics, as pure functions.

Modules, in data-flow order:

- :mod:`staleness.config` — the ``[staleness]`` config tree (no torch).
- :mod:`staleness.lag` — per-token / episode / group lag from version stamps, the drop rule
  (no torch).
- :mod:`staleness.corrections` — per-token weights and masks for ``none``, ``tis``, ``mis``,
  ``decoupled_ppo``, ``token_mask`` and ``m2po``; ``cispo`` and ``gspo`` name a surrogate.
- :mod:`staleness.surrogates` — the per-token policy-gradient terms: PPO-clip, CISPO, GSPO.
- :mod:`staleness.loss` — GRPO advantages, the policy term composed with a correction, KL terms.
- :mod:`staleness.metrics` — lag histogram, length-bias guard, IS statistics, ESS, mismatch.

This package file imports nothing, so ``import staleness.config`` stays torch-free.
"""
