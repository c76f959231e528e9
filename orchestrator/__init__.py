"""The async core, in data-flow order (imports only run down this list; a test checks it).

- :mod:`orchestrator.types`, :mod:`orchestrator.errors`, :mod:`orchestrator.config` — the
  vocabulary, the error tree and the one pydantic config tree (torch-free);
- :mod:`orchestrator.record` — what a run writes: trajectory frames and log, the event log, the
  exactly-once accounting, resume;
- :mod:`orchestrator.loop` — the live loop: pool, client, episode runner, scheduler, batcher,
  train sink, local fleet, admin API, and :func:`~orchestrator.loop.rl.rl_loop` wiring them;
- :mod:`orchestrator.observe` — Prometheus metrics, TensorBoard scalars, the live view;
- :mod:`orchestrator.offline` — inspect, replay, resimulate, report, experiment;
- :mod:`orchestrator.run` — one run, end to end; :mod:`orchestrator.train_worker` — the reference
  trainer as an external process; :mod:`orchestrator.bench` and :mod:`orchestrator.chaos` —
  benchmarks, the simulator and fault injection; :mod:`orchestrator.cli` — ``orchestrate``.
"""
