"""OpenAI-compatible routes over the lane: ``/v1/chat/completions`` and ``/v1/completions``.

Both routes turn the request into a :class:`GenerateRequest` (token ids, the same sampling
fields, the same ``policy_version`` bounds), run it through the sidecar like ``/v1/generate``, and
answer in OpenAI's shape plus the lane's extensions: top-level ``prompt_token_ids`` and
``policy_version`` stamp, per-choice ``token_ids``.

Chat: ``messages`` and ``tools`` are rendered with the model's chat template
(``apply_chat_template``, generation prompt added); the generated text is split into reasoning
(``reasoning_content``), content and OpenAI ``tool_calls`` by the served model's tool-call parser
(:mod:`policies.wire.tool_parsers`): the one named by ``tool_parser``, else the one detected from
the tokenizer's chat template. The parser's markers that are special tokens (``[TOOL_CALLS]``,
``<|python_tag|>``) are kept when the reply is decoded; every other special token is skipped.
``tool_choice``: ``"none"`` renders no tools, ``"auto"`` (default with tools) lets the model
choose, ``"required"`` and a named function are enforced by prefilling the assistant turn with
the start of a call in the parser's dialect (the prefill is part of ``prompt_token_ids``, so the
result stays token-exact). ``logprobs: true`` returns ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": []}]}``, the log prob of each sampled token under the distribution it
was sampled from.

Completions: ``prompt`` is text (encoded without special tokens) or a list of token ids;
``logprobs: 0|1`` returns the legacy ``{"tokens", "token_logprobs", "text_offset"}`` object.

Tokenizing the prompt (chat template, encoding, stop strings) and decoding the reply run in
worker threads (at most :data:`TOKENIZER_THREADS` at once, apart from anyio's default pool that
activations use), never on the event loop: a prompt of a megabyte takes about a second to encode,
and ``/health`` and every other request go on meanwhile. What that costs is bounded before it is
spent: a long prompt text (the rendered chat, a completion's text) is counted a piece at a time
and refused once it cannot fit the model's context (:mod:`policies.serve.prompt_size`), and a
stop string longer than a piece is refused unencoded; errors quote a request's text cut short.

A choice that failed alone (one row of an ``n > 1`` request) is answered beside the others with
``finish_reason: "error"`` and an ``error`` object (``{"type", "message"}``, as a failed request's
body holds), its text or message being what it had sampled; only a request none of whose choices
was sampled gets an error status. OpenAI's shape has no per-choice error: this is the
convention of OpenAI-compatible routers (a choice with ``finish_reason: "error"`` and ``error``).

Errors: every invalid request raises :class:`BadRequest` naming the field. ``stop`` strings must
each be a single token of the vocabulary (they become stop token ids, so generation really
stops there); multi-token stop strings are refused, not approximated.

Not covered: streaming, top-k alternatives in logprobs (``top_logprobs`` > 0), ``echo``, penalties.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from transformers import PreTrainedTokenizerBase

from policies.errors import BadRequest
from policies.model.chat_template import noted_tool_parser
from policies.serve.prompt_size import PIECE_CHARS, shown, tokens_over
from policies.serve.sidecar import Sidecar, stamps
from policies.serve.types import Generation
from policies.wire import tool_parsers
from policies.wire.chat_tokens import control_texts, mark_control_text, plain_text_ids
from policies.wire.lane import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    NamedToolChoice,
    OpenAIUsage,
    TokenLogprob,
    VersionStamp,
)
from policies.wire.toolcalls import THINK_CLOSE, THINK_OPEN, to_openai_message

DEFAULT_MAX_TOKENS = 256
TOKENIZER_THREADS = 4
"""Requests tokenized (or decoded) at once; more wait their turn, off the event loop."""
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


_TYPE_TAGS = ("str", "int", "float", "bool", "none")


def param_of(loc: tuple[int | str, ...]) -> str | None:
    """The field path of a pydantic error location, without the union-member type tags."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or not (p[:1].isupper() or "[" in p or "(" in p or p in _TYPE_TAGS)
    ]
    return ".".join(parts) or None


def parse_body(model: type[M], payload: Any) -> M:
    """Validate ``payload`` as ``model``; a failure names the first offending field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = param_of(tuple(err["loc"]))
        raise BadRequest(f"{param}: {err['msg']}", param) from None


class OpenAIRoutes:
    """Builds and answers the OpenAI-shaped requests for one sidecar and tokenizer.

    ``tool_parser`` names the tool-call dialect (a :data:`~policies.wire.tool_parsers.TOOL_PARSERS`
    key); None: the one ``init-model`` noted in the tokenizer's directory (``sprawl.json``), else
    detected from the tokenizer's chat template.
    """

    def __init__(
        self,
        sidecar: Sidecar,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tool_parser: str | None = None,
    ) -> None:
        self.sidecar = sidecar
        self.tokenizer = tokenizer
        self._control = control_texts(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates ("default", "tool_use", …)
            template = "\n".join(str(t) for t in template.values())
        source = getattr(tokenizer, "name_or_path", "")
        name = tool_parser or (noted_tool_parser(Path(source)) if source else None)
        name = name or tool_parsers.detect_tool_parser(template)
        self.parser = tool_parsers.tool_parser(name)
        kept = {*self.parser.markers, THINK_OPEN, THINK_CLOSE}
        self._kept_ids = {
            int(i): tok.content
            for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if tok.special and tok.content in kept
        }
        self._threads = anyio.CapacityLimiter(TOKENIZER_THREADS)

    async def _off_loop(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` in a tokenizer thread (the event loop keeps serving)."""
        return await anyio.to_thread.run_sync(partial(fn, *args), limiter=self._threads)

    # -- shared ---------------------------------------------------------------------------------
    def _stop_ids(self, stops: list[str]) -> list[int]:
        ids = []
        for s in stops:
            long = len(s) > PIECE_CHARS  # not one token of any vocabulary: not encoded
            enc = [] if long else self.tokenizer.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                count = "not one token" if long else f"{len(enc)} tokens"
                raise BadRequest(
                    f"stop string {shown(s)} is {count}; only single-token stop strings "
                    "are supported (or pass stop_token_ids)",
                    "stop",
                )
            ids.append(int(enc[0]))
        return ids

    def _check_size(self, parts: list[tuple[str, bool]], param: str) -> None:
        """Refuse a prompt text that cannot fit the context before it is encoded whole
        (:mod:`policies.serve.prompt_size`)."""
        context = self.sidecar.backend.max_context
        over = tokens_over(self.tokenizer, parts, context)
        if over is not None:
            raise BadRequest(
                f"prompt has over {over} tokens; the model's context is {context}", param
            )

    def _lane(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt: list[int],
        max_tokens: int | None,
    ) -> GenerateRequest:
        if len(prompt) >= self.sidecar.backend.max_context:
            raise BadRequest(
                f"prompt has {len(prompt)} tokens; the model's context is "
                f"{self.sidecar.backend.max_context}",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        return GenerateRequest(
            prompt_token_ids=prompt,
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop_token_ids=[*req.stop_token_ids, *self._stop_ids(req.stops())],
            n=req.n,
            policy_version=req.policy_version,
        )

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _decode_reply(self, ids: list[int]) -> str:
        """Like :meth:`_decode`, keeping the special tokens the tool-call parser reads."""
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._kept_ids:
                parts += [self._decode(run), self._kept_ids[i]]
                run = []
            else:
                run.append(i)
        return "".join([*parts, self._decode(run)])

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [str(self.tokenizer.decode([i])) for i in ids]

    # -- chat -----------------------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], str]:
        """The prompt token ids for ``req`` and the text prefilled into the assistant turn."""
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            for call in m.get("tool_calls", []):
                args = call["function"].get("arguments")
                if isinstance(args, str):
                    try:
                        json.loads(args)
                    except json.JSONDecodeError:
                        raise BadRequest(
                            "assistant tool call arguments are not JSON", "messages"
                        ) from None
        tools: list[dict[Any, Any] | Callable[..., Any]] | None = None
        if req.tools and req.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        marked, texts = mark_control_text(messages, self._control)  # never control tokens
        try:
            text = self.tokenizer.apply_chat_template(
                marked, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises its own error types on unrenderable input
            raise BadRequest(f"messages cannot be rendered: {exc}", "messages") from None
        prefill = ""
        if isinstance(req.tool_choice, NamedToolChoice):
            prefill = self.parser.prefill(req.tool_choice.function.name)
        elif req.tool_choice == "required":
            prefill = self.parser.prefill()
        text = str(text) + prefill
        self._check_size([(text, False), *((t, True) for t in texts)], "messages")
        ids = plain_text_ids(self.tokenizer, text, texts)
        return [int(i) for i in ids], prefill

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        prompt, prefill, lane = await self._off_loop(self._chat_request, req)
        gen = await self.sidecar.run_request(lane)
        return await self._off_loop(self._chat_answer, req, prompt, prefill, gen)

    def _chat_request(self, req: ChatCompletionRequest) -> tuple[list[int], str, GenerateRequest]:
        prompt, prefill = self.chat_prompt(req)
        return prompt, prefill, self._lane(req, prompt, req.max_completion_tokens or req.max_tokens)

    def _chat_answer(
        self, req: ChatCompletionRequest, prompt: list[int], prefill: str, gen: Generation
    ) -> ChatCompletionResponse:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        response_id = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        choices = []
        for c in gen.choices:
            text = prefill + self._decode_reply(c.token_ids)
            # the response's id seeds call ids (Mistral's: 9 alphanumerics, distinct per reply)
            parsed = self.parser.parse(text, tools=tools, id_seed=f"{response_id}:{c.index}")
            finish = c.finish_reason
            finish_out = "tool_calls" if parsed.tool_calls and finish == "stop" else finish
            logprobs = None
            if req.logprobs:
                logprobs = ChatLogprobs(
                    content=[
                        TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                        for t, lp in zip(self._token_texts(c.token_ids), c.logprobs, strict=True)
                    ]
                )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=to_openai_message(parsed),
                    finish_reason=finish_out,
                    logprobs=logprobs,
                    token_ids=c.token_ids,
                    error=c.error,
                )
            )
        return ChatCompletionResponse(
            id=response_id, choices=choices, **self._envelope(gen, prompt)
        )

    # -- completions ----------------------------------------------------------------------------
    async def complete(self, req: CompletionRequest) -> CompletionResponse:
        prompt, lane = await self._off_loop(self._completion_request, req)
        try:
            gen = await self.sidecar.run_request(lane)
        except BadRequest as exc:
            param = "prompt" if exc.param == "prompt_token_ids" else exc.param
            raise BadRequest(str(exc), param) from None
        return await self._off_loop(self._completion_answer, req, prompt, gen)

    def _completion_request(self, req: CompletionRequest) -> tuple[list[int], GenerateRequest]:
        if isinstance(req.prompt, str):
            self._check_size([(req.prompt, False)], "prompt")
            prompt = [int(i) for i in self.tokenizer.encode(req.prompt, add_special_tokens=False)]
            if not prompt:
                raise BadRequest("prompt encodes to no tokens", "prompt")
        else:
            prompt = list(req.prompt)
        return prompt, self._lane(req, prompt, req.max_tokens)

    def _completion_answer(
        self, req: CompletionRequest, prompt: list[int], gen: Generation
    ) -> CompletionResponse:
        choices = []
        for c in gen.choices:
            logprobs = None
            if req.logprobs is not None:
                texts = self._token_texts(c.token_ids)
                offsets, pos = [], 0
                for t in texts:
                    offsets.append(pos)
                    pos += len(t)
                logprobs = CompletionLogprobs(
                    tokens=texts, token_logprobs=c.logprobs, text_offset=offsets
                )
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=self._decode(c.token_ids),
                    finish_reason=c.finish_reason,
                    logprobs=logprobs,
                    token_ids=c.token_ids,
                    error=c.error,
                )
            )
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex[:16]}", choices=choices, **self._envelope(gen, prompt)
        )

    def _envelope(self, gen: Generation, prompt: list[int]) -> dict[str, Any]:
        """The fields both OpenAI responses share: time, model, usage, prompt ids, versions."""
        start, end = stamps(gen, self.sidecar.applied_version)
        completion = sum(len(c.token_ids) for c in gen.choices)
        return {
            "created": int(time.time()),
            "model": self.sidecar.board.run,
            "usage": OpenAIUsage(
                prompt_tokens=len(prompt),
                completion_tokens=completion,
                total_tokens=len(prompt) + completion,
            ),
            "prompt_token_ids": prompt,
            "policy_version": VersionStamp(start=start, end=end),
        }
