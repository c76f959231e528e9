"""Benchmarks (``orchestrate bench …``; results in ``docs/benchmarks.md``) and the simulator.

:mod:`~orchestrator.bench.codec` (its ``--churn``: :mod:`~orchestrator.bench.churn`),
:mod:`~orchestrator.bench.sparsity`,
:mod:`~orchestrator.bench.engine`, :mod:`~orchestrator.bench.sync`,
:mod:`~orchestrator.bench.publish`, :mod:`~orchestrator.bench.fleet`,
:mod:`~orchestrator.bench.scheduler`,
:mod:`~orchestrator.bench.async_rl`,
:mod:`~orchestrator.bench.device` (the device path in one run, ``scripts/gpu-check.sh``; its
parts ``device_codec``, ``device_publish``, ``device_trainer``, ``device_engine``); and
:mod:`~orchestrator.bench.simulate`, a simulated heterogeneous fleet. Each prints its baseline
measured in the same run. Nothing at run time imports this package.

Pieces they share: :mod:`~orchestrator.bench.link` (a slow link between board and island),
:mod:`~orchestrator.bench.synthetic` (synthetic bf16 views and Adam-like steps),
:mod:`~orchestrator.bench.optimizer_steps` (real optimizer steps on a model).
"""
