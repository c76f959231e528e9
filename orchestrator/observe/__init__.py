"""Observing a run: :mod:`~orchestrator.observe.metrics` (Prometheus, from the events),
:mod:`~orchestrator.observe.scalars` (TensorBoard per step), :mod:`~orchestrator.observe.live`
(the terminal view)."""
