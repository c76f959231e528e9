"""Rollout islands on a Ray cluster (``[fleet.ray]``), supervised by the run.

:mod:`~orchestrator.rayfleet.island` is the actor that runs one island's processes on its node;
:mod:`~orchestrator.rayfleet.launch` places actors and watches them as islands of the run's
supervisor (:mod:`orchestrator.loop.supervisor`), the same one that restarts local engines.
Ray is an optional extra: ``pip install 'sprawl[ray]'``.
"""
