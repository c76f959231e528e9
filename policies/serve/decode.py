"""Continuous batching for the reference engine: requests join and leave at decode-step boundaries.

Design. One scheduler thread owns the model's forward passes. The active sequences ("rows", one
per choice of a request) share one batched KV cache, kept per layer as ``[rows, kv_heads, L,
head_dim]`` key/value tensors that are *right-aligned*: a shorter sequence is left-padded, and a
``[rows, L]`` attention mask marks its real positions (:mod:`policies.serve.kv_cache`; a request
and its rows are :mod:`policies.serve.decode_rows`). Every loop iteration is one decode-step
boundary:

1. **join** — waiting requests are admitted (unless the scheduler is gated or paused). A joining
   request is checked against its ``policy_version`` bounds at the version applied *now*, its
   prompt is prefilled alone (batch 1, no padding), the first token of each of its ``n`` choices
   is sampled from the prefill logits, the prompt cache is replicated ``n`` times and merged into
   the batch (whichever side is shorter is left-padded);
2. **step** — one forward over every row's last token, with per-row position ids (the row's real
   length) and the padded mask; each row samples from its own logits with its own generator;
3. **leave** — rows that hit a stop token or their token budget (or whose caller went away) are
   removed from the cache, and leading columns that only hold padding are dropped.

A request's future resolves when all its rows have left. Cancelling the future (what the lane
does when its client disconnects) is the abandon signal: at the next step boundary the request
leaves the queue, or its rows leave the batch and their KV cache is freed; each such request is
logged once (``generation_cancelled``, with the rows freed and the tokens they had sampled) and
counted in :attr:`DecodeBatcher.cancelled`.

Guarantees:

- per-request semantics do not depend on batching: choice ``i`` samples with a generator seeded
  ``seed + i``, stops at the first stop token (which it keeps), is limited by ``max_tokens`` and
  the model's context, and reports the log prob of each sampled token under the distribution it
  was sampled from (see :func:`policies.serve.sampling.sample_token`);
- a request alone in the batch computes exactly what an unbatched loop would; in a mixed batch
  padded attention may change logits in the last bits of float precision (masked positions get
  weight exactly zero, but reduction shapes differ), so a seeded request is reproducible run to
  run under the same load, and token-identical under any load except where two candidate tokens
  are within float rounding of a sampling boundary;
- a failure that belongs to one row (sampling it, e.g. NaN logits) fails that row alone: its
  request is answered with its other rows, the failed one's choice carrying the error
  (``finish_reason`` ``"error"``: :meth:`Row.fail`), or fails with :class:`EngineError` when
  every row failed. A failure of one request's prefill fails that request alone; every other row
  keeps decoding. Only a failed batched forward, which every row shares, fails every row in
  flight;
- :meth:`DecodeBatcher.quiesce` gives the caller the model at a step boundary with no forward
  in progress: mode ``"pause"`` holds in-flight rows where they are (they resume afterwards, with
  the new weights), mode ``"wait"`` stops admitting and lets in-flight rows finish first. Either
  way every request is stamped with the version applied when it joined and when it left.

For an MoE model (Qwen2-MoE / Qwen3-MoE routers, :mod:`policies.model.moe`) every forward records
the experts each token was routed to, and each choice returns them as ``routed_experts`` in
vLLM's form (:mod:`policies.wire.routing`): the prompt's positions from the request's
``routed_experts_prompt_start`` on (from its prefill, shared by its ``n`` choices), then each
sampled token but the last (from the decode step that forwarded it).

On an engine serving LoRA versions (:mod:`policies.serve.adapters`) a joining request is given the
newest resident adapter its bounds admit (none: :class:`OutOfBounds`), its rows run through that
adapter in every forward of the mixed batch, and it is stamped with that version at start and end.

Not covered: prefix sharing between requests, chunked prefill (a long prompt's prefill delays
one step for everybody), and preemption when memory runs out (``max_rows`` bounds the batch).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import structlog
import torch
from transformers import DynamicCache

from policies.errors import EngineError
from policies.model.moe import RoutingRecorder
from policies.serve.adapters import ResidentAdapters
from policies.serve.decode_rows import Job, Row
from policies.serve.kv_cache import KV, keep_rows, merge
from policies.serve.sampling import sample_token
from policies.serve.types import Generation, OutOfBounds, QuiesceMode, failure
from policies.wire.lane import GenerateChoice, GenerateRequest, choice_seed
from policies.wire.routing import encode_routing

log = structlog.get_logger(__name__)


class DecodeBatcher:
    """Steps every active sequence of one model together, on its own thread."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, max_rows: int = 64):
        self.model = model
        self.device = device
        self.max_rows = max_rows
        self.version: int | None = None
        self.adapters: ResidentAdapters | None = None  # set once the engine serves LoRA versions
        self.steps = 0
        self.cancelled = 0  # requests whose caller went away before they finished
        self._routing = RoutingRecorder(model)
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._rows: list[Row] = []
        self._kv: KV = []
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self._pauses = 0
        self._gates = 0
        self._parked = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="sprawl-batcher", daemon=True)
        self._thread.start()

    # -- public ---------------------------------------------------------------------------------
    @property
    def active_rows(self) -> int:
        return len(self._rows)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def submit(
        self, req: GenerateRequest, max_tokens: int, stops: frozenset[int]
    ) -> concurrent.futures.Future[Generation]:
        """Queue a validated request; the future resolves with its :class:`Generation`."""
        fut: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise EngineError("engine is shut down")
            self._waiting.append(Job(req, max_tokens, stops, fut))
            self._cv.notify_all()
        return fut

    @contextmanager
    def quiesce(self, mode: QuiesceMode) -> Iterator[float]:
        """Hold the model at a step boundary; yields seconds spent waiting to get there."""
        t0 = time.perf_counter()
        with self._cv:
            if mode == "pause":
                self._pauses += 1
            else:
                self._gates += 1
            self._cv.notify_all()
            try:
                while not (self._parked and (mode == "pause" or not self._rows)):
                    self._cv.wait()
                if mode == "wait":
                    self._pauses += 1  # stay parked while the caller works
                    self._gates -= 1
                    mode = "pause"
            except BaseException:
                self._release(mode)
                raise
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cv:
                self._release(mode)

    def _release(self, mode: QuiesceMode) -> None:
        if mode == "pause":
            self._pauses -= 1
        else:
            self._gates -= 1
        self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while self._pauses or not (self._rows or (self._waiting and not self._gates)):
                        if self._closed:
                            self._fail_all(EngineError("engine is shut down"))
                            return
                        self._parked = True
                        self._cv.notify_all()
                        self._cv.wait()
                    self._parked = False
                    self._drop_cancelled_waiting()
                    joining: list[Job] = []
                    while self._waiting and not self._gates and self._room_for(self._waiting[0]):
                        joining.append(self._waiting.popleft())
                try:
                    for job in joining:
                        self._join_alone(job)
                    self._drop_finished()
                    if self._rows:
                        self._step()
                        self._drop_finished()
                except Exception as exc:  # a failed forward must not kill the engine
                    log.exception("batch_step_failed", rows=len(self._rows))
                    error = EngineError(f"generation failed: {exc}")
                    for job in joining:  # jobs taken from the queue but not yet rows
                        job.fail(error)
                    self._fail_all(error)

    def _room_for(self, job: Job) -> bool:
        return not self._rows or len(self._rows) + job.req.n <= self.max_rows

    def _join_alone(self, job: Job) -> None:
        """Join ``job``; if its own prefill or sampling fails, fail it alone."""
        try:
            rows = self._prefill(job)
        except Exception as exc:  # this request's failure: the batch is untouched so far
            log.exception("request_join_failed", rows=job.req.n)
            job.fail(EngineError(f"generation failed: {exc}"))
            return
        if rows is not None:
            live, kv, mask = rows
            self._merge(kv, mask)
            self._rows.extend(live)

    def _prefill(self, job: Job) -> tuple[list[Row], KV, torch.Tensor] | None:
        """The rows of ``job`` still to decode, with their KV cache and mask; None if none."""
        if job.future.cancelled():
            self._count_cancelled(job, [])
            return None
        if self.adapters is not None:
            job.adapter = self.adapters.pick(job.req.policy_version)
            admitted = job.adapter is not None
        else:
            admitted = self.version is None or job.req.policy_version.admits(self.version)
        if not admitted:
            job.fail(OutOfBounds(self.version))
            return None
        job.start = self.version if job.adapter is None else job.adapter
        req = job.req
        ids = torch.tensor([req.prompt_token_ids], device=self.device)
        self._routing.discard()
        out = self.model(ids, use_cache=True, **self._lora([job]))
        if self._routing.active:
            job.prompt_routes = self._routing.take()
        logits = out.logits[0, -1].float()
        kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        rows = []
        for i in range(req.n):
            row = Row(job, i, torch.Generator(device=self.device), cached=len(req.prompt_token_ids))
            try:
                seed = choice_seed(req.seed, i)
                if seed is None:
                    row.gen.seed()
                else:
                    row.gen.manual_seed(seed)
                row.take(*sample_token(logits, req.temperature, req.top_k, req.top_p, row.gen))
            except Exception as exc:  # this row's failure, no other's
                self._row_failed(row, exc)
            rows.append(row)
        live = [r for r in rows if r.finish is None]
        for r in rows:
            if r.finish is not None:
                self._finish(r)
        if not live:
            return None
        width = len(live)
        kv = [(k.expand(width, -1, -1, -1), v.expand(width, -1, -1, -1)) for k, v in kv]
        mask = torch.ones(width, ids.shape[1], dtype=torch.long, device=self.device)
        return live, kv, mask

    def _merge(self, kv: KV, mask: torch.Tensor) -> None:
        if not self._rows:
            self._kv, self._mask = [(k.contiguous(), v.contiguous()) for k, v in kv], mask
            return
        self._kv, self._mask = merge(self._kv, self._mask, kv, mask)

    def _step(self) -> None:
        rows = self._rows
        last = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
        pos = torch.tensor([[r.cached] for r in rows], device=self.device)
        mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=1)
        cache = DynamicCache(self._kv)
        self._routing.discard()
        out = self.model(
            last,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            **self._lora([r.job for r in rows]),
        )
        routes = self._routing.take() if self._routing.active else None
        self._kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        self._mask = mask
        logits = out.logits[:, -1].float()
        for i, row in enumerate(rows):
            row.cached += 1
            req = row.job.req
            if routes is not None:
                row.routes.append(routes[i])
            try:
                row.take(*sample_token(logits[i], req.temperature, req.top_k, req.top_p, row.gen))
            except Exception as exc:  # this row's failure, no other's
                self._row_failed(row, exc)
        self.steps += 1

    def _row_failed(self, row: Row, exc: Exception) -> None:
        log.warning("row_failed", error=str(exc), choice=row.index, rows=row.job.req.n)
        row.fail(exc)

    def _drop_cancelled_waiting(self) -> None:
        """Forget queued requests whose caller went away (under the lock)."""
        gone = [j for j in self._waiting if j.future.cancelled()]
        if gone:
            self._waiting = deque(j for j in self._waiting if not j.future.cancelled())
            for job in gone:
                self._count_cancelled(job, [])

    def _count_cancelled(self, job: Job, rows: list[Row]) -> None:
        self.cancelled += 1
        log.info(
            "generation_cancelled",
            rows=len(rows),
            tokens=sum(len(r.tokens) for r in rows),
            max_tokens=job.max_tokens,
        )

    def _drop_finished(self) -> None:
        abandoned: dict[Job, list[Row]] = {}
        for r in self._rows:
            if r.finish is None and r.job.future.cancelled():
                r.finish = "abort"
                abandoned.setdefault(r.job, []).append(r)
        for job, rows in abandoned.items():
            self._count_cancelled(job, rows)
        keep = [i for i, r in enumerate(self._rows) if r.finish is None]
        if len(keep) == len(self._rows):
            return
        for r in self._rows:
            if r.finish is not None:
                self._finish(r)
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._kv, self._mask = [], self._mask[:0, :0]
            return
        idx = torch.tensor(keep, device=self.device)
        self._kv, self._mask = keep_rows(self._kv, self._mask, idx)

    def _finish(self, row: Row) -> None:
        job = row.job
        assert row.finish is not None
        failed = job.failures.get(row.index)
        job.choices[row.index] = GenerateChoice(
            index=row.index,
            token_ids=row.tokens,
            logprobs=row.logprobs,
            finish_reason=row.finish,
            routed_experts=self._routed_experts(row) if failed is None else None,
            error=None if failed is None else failure(failed)[1],
        )
        job.end = self.version if job.adapter is None else job.adapter
        if len(job.choices) == job.req.n:
            job.settle()

    def adapters_in_use(self) -> set[int]:
        """The LoRA versions in-flight rows run through (call at a step boundary)."""
        return {r.job.adapter for r in self._rows if r.job.adapter is not None}

    def _lora(self, jobs: list[Job]) -> dict[str, list[str]]:
        """The forward's keyword that runs each row through its job's adapter (none without)."""
        if self.adapters is None:
            return {}
        return self.adapters.forward_args([j.adapter for j in jobs if j.adapter is not None])

    def _routed_experts(self, row: Row) -> str | None:
        """The row's routing in vLLM's ``routed_experts`` form; None for a dense model."""
        prompt = row.job.prompt_routes
        if prompt is None:
            return None
        ids = torch.cat([prompt[row.job.req.routed_experts_prompt_start :], *map(_one, row.routes)])
        return encode_routing(ids.numpy(), self._routing.experts)

    def _fail_all(self, exc: EngineError) -> None:
        jobs = {id(r.job): r.job for r in self._rows}
        jobs.update({id(j): j for j in self._waiting})
        self._rows, self._kv = [], []
        self._waiting.clear()
        for job in jobs.values():
            job.fail(exc)


def _one(route: torch.Tensor) -> torch.Tensor:
    return route[None]
