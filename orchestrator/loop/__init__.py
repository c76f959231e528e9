"""The live loop: episodes out to the fleet, groups in, batches to the trainer.

- :mod:`~orchestrator.loop.pool` — the endpoints, routing by version, breakers, failover;
- :mod:`~orchestrator.loop.client` — the HTTP transport of the request lane;
- :mod:`~orchestrator.loop.episode` — one multi-turn episode (``EpisodeRunner``);
  :mod:`~orchestrator.loop.verifiers_episode` — one episode of a verifiers environment;
- :mod:`~orchestrator.loop.scheduler` — admission under the lag budget (``Scheduler``);
- :mod:`~orchestrator.loop.batcher` — the staleness decision per group, batches of groups;
- :mod:`~orchestrator.loop.train_sink` — the trainer in this process or behind batch files;
- :mod:`~orchestrator.loop.rl` — :func:`rl_loop`, the one wiring of the pieces above;
- :mod:`~orchestrator.loop.admin` — the admin API (fleet add / remove / list, ``/metrics``);
- :mod:`~orchestrator.loop.feed` — the batch feed an external trainer pulls from;
- :mod:`~orchestrator.loop.feed_sink` — the trainer behind the feed, batches handed over ahead.

The fleet the loop routes to is started and supervised by :mod:`orchestrator.fleet`.
"""
