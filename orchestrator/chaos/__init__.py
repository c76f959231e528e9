"""Fault injection: run the real loop, break one thing, check that nothing was lost, duplicated
or served wrong (``orchestrate chaos``; results in ``docs/reliability.md``).

- :mod:`~orchestrator.chaos.faults` — the faults and how each is injected;
- :mod:`~orchestrator.chaos.harness` — one trial: processes, trigger, injection, waiting;
- :mod:`~orchestrator.chaos.invariants` — what is checked afterwards, from logs and the board;
- :mod:`~orchestrator.chaos.link` — a proxy that makes an endpoint fail, garble or crawl;
- :mod:`~orchestrator.chaos.envs` — environments that raise or use the sandbox on purpose.
"""
