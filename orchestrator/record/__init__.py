"""What a run writes, and reading it back.

- :mod:`~orchestrator.record.frames` — crash-safe zstd JSONL frames (the storage of both logs);
- :mod:`~orchestrator.record.trajlog` — the trajectory log: episodes, groups, batches;
- :mod:`~orchestrator.record.events` — the event log: every routing, admission and staleness
  decision;
- :mod:`~orchestrator.record.accounting` — exactly-once accounting from both logs;
- :mod:`~orchestrator.record.resume` — continuing a run from its logs and checkpoint.
"""
