"""Tools over a finished (or running) run's logs.

- :mod:`~orchestrator.offline.inspect_log` — ``orchestrate inspect``: tables and transcripts;
- :mod:`~orchestrator.offline.replay` — ``orchestrate replay``: what-if staleness policies
  (:mod:`~orchestrator.offline.what_if`), retraining from the log;
- :mod:`~orchestrator.offline.resimulate` — re-derive every logged decision from the event log;
- :mod:`~orchestrator.offline.report` — ``orchestrate report``: the HTML report;
- :mod:`~orchestrator.offline.experiment` — ``orchestrate experiment lag``, with its arms
  (:mod:`~orchestrator.offline.experiment_arms`), its verdict
  (:mod:`~orchestrator.offline.experiment_verdict`) and its page
  (:mod:`~orchestrator.offline.experiment_report`).
"""
