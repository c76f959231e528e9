"""A request inside the decode batcher, and the rows it decodes as (one per choice).

A :class:`Job` is a request from the moment it is queued: its token budget and stop tokens, the
future its caller waits on, the versions it is stamped with, the choices finished so far, and the
MoE routing and LoRA adapter it runs with. A :class:`Row` is one of its ``n`` choices while it
decodes: its own generator, how many of its tokens are in the KV cache, the tokens and log probs
sampled so far, and why it finished.

Guarantees: a row finishes at its first stop token (which it keeps), once it holds
``max_tokens`` tokens, or when it fails alone (:meth:`Row.fail`: ``finish`` ``"error"``, the
tokens it had sampled kept); once every row of a job has finished, :meth:`Job.settle` resolves it
with its choices, a failed row's carrying its error, or fails it when every row failed;
:meth:`Job.resolve` and :meth:`Job.fail` deliver at most one outcome, and leave a future its
caller cancelled (maybe just now, from another thread) as it is.
"""

from __future__ import annotations

import concurrent.futures
from contextlib import suppress
from dataclasses import dataclass, field

import torch

from policies.errors import EngineError
from policies.serve.types import Generation
from policies.wire.lane import FinishReason, GenerateChoice, GenerateRequest


@dataclass(eq=False)
class Job:
    req: GenerateRequest
    max_tokens: int
    stops: frozenset[int]
    future: concurrent.futures.Future[Generation]
    start: int | None = None
    end: int | None = None
    choices: dict[int, GenerateChoice] = field(default_factory=dict)
    prompt_routes: torch.Tensor | None = None  # [prompt tokens, layers, top_k] (MoE models)
    adapter: int | None = None  # the LoRA version its rows run through (LoRA engines)

    failures: dict[int, EngineError] = field(default_factory=dict)  # by choice index

    def settle(self) -> None:
        """Every row has finished: resolve with the choices, or fail with the first row's error
        when every row failed (a request none of whose choices was sampled has failed)."""
        if len(self.failures) == self.req.n:
            self.fail(self.failures[min(self.failures)])
        else:
            choices = [self.choices[i] for i in range(self.req.n)]
            self.resolve(Generation(choices, self.start, self.end))

    def resolve(self, result: Generation) -> None:
        """Deliver ``result`` unless the caller has gone (its future cancelled, maybe just now,
        from another thread: checking ``done()`` first would race with that)."""
        with suppress(concurrent.futures.InvalidStateError):
            self.future.set_result(result)

    def fail(self, exc: Exception) -> None:
        """Fail the job unless it is already finished or its caller has gone (see
        :meth:`resolve`)."""
        with suppress(concurrent.futures.InvalidStateError):
            self.future.set_exception(exc)


@dataclass(eq=False)
class Row:
    job: Job
    index: int
    gen: torch.Generator
    cached: int  # real tokens in the KV cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    routes: list[torch.Tensor] = field(default_factory=list)  # [layers, top_k] per forwarded token

    def fail(self, exc: Exception) -> None:
        """This row failed alone (its sampling raised): it leaves at the next step boundary, its
        choice carrying the error; its request's other rows go on."""
        self.job.failures[self.index] = EngineError(f"generation failed: {exc}")
        self.finish = "error"

    def take(self, token: int, logprob: float) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.job.stops:
            self.finish = "stop"
        elif len(self.tokens) >= self.job.max_tokens:
            self.finish = "length"
