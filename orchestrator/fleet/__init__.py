"""The fleet: the islands a run starts and supervises, here and on Ray, and the fleet CLI.

- :mod:`~orchestrator.fleet.local` — the run's local islands (reference engines, and the other
  kinds of :mod:`~orchestrator.fleet.islands`: vLLM, llama.cpp), started together;
- :mod:`~orchestrator.fleet.children` — their processes, and the one way a serving command's
  argv is built (:func:`~orchestrator.fleet.children.sprawl_command`);
- :mod:`~orchestrator.fleet.guard` — an engine process group that dies with the orchestrator;
- :mod:`~orchestrator.fleet.supervisor` — restarts an island that dies, gives up after
  ``fleet.max_restarts``;
- :mod:`~orchestrator.fleet.ray_cluster`, :mod:`~orchestrator.fleet.ray_island` (the actor that
  runs one island's processes on its node), :mod:`~orchestrator.fleet.ray_launch` (places actors
  and watches them as islands of the same supervisor), :mod:`~orchestrator.fleet.ray_scale`
  (``orchestrate fleet scale``) — islands on a Ray cluster (``[fleet.ray]``; Ray is an optional
  extra: ``pip install 'sprawl[ray]'``);
- :mod:`~orchestrator.fleet.cli` — ``orchestrate fleet add|remove|list|up|scale|down``, a client
  of the run's admin API.
"""
