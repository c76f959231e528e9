"""The model client a verifiers environment's rollout calls: sprawl's policy, token-exact.

:class:`PolicyClient` is an OpenAI-compatible async client (``client.chat.completions.create``)
for one episode; :func:`verifiers_client` wraps it in verifiers' own
``OpenAIChatCompletionsClient``. Guarantees:

- each call hands the runner only the messages the environment added since the model's last turn
  (:data:`ModelCall`), so the runner extends the token sequence token-exactly and never
  re-tokenizes the history; when the environment sends a history that differs from what the
  model wrote or saw, the tokens stay what the model saw and :attr:`PolicyClient.rewritten`
  records it;
- ``state.messages`` is what the model saw and wrote; tool results are recorded on the state,
  and a malformed tool-call block as a ``malformed_call`` tool call with its error (counted in
  ``state.bad_calls``; the environment sees the message without it, as from an OpenAI server);
- the first failure of a model call is kept (:attr:`PolicyClient.failure`), so it reaches the
  runner as itself rather than as the ``ModelError`` verifiers wraps it in;
- the verifiers rollout state is kept on the episode's state (``state.data[STATE_KEY]``) from
  the first call on, so an episode cut short can still be scored.

Sampling arguments the environment passes are logged and not used (sampling is the run's
``[sampling]``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from environments.base import MALFORMED_CALL
from environments.types import EpisodeState
from policies.wire.lane import FinishReason
from policies.wire.toolcalls import Message, ParsedAssistant, ToolCall, to_openai_message

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion

log = structlog.get_logger(__name__)
MODEL_NAME = "sprawl-policy"
"""The ``model`` a verifiers environment's calls name (the run's policy answers them)."""
STATE_KEY = "verifiers_state"
"""The :attr:`EpisodeState.data` key of the verifiers rollout state."""


@dataclass(frozen=True)
class Sampled:
    """One model call as the policy made it, what the environment's client answers with."""

    parsed: ParsedAssistant
    prompt_token_ids: list[int]
    token_ids: list[int]
    tokens: list[str]
    """The sampled tokens' text, one per id (the ``logprobs.content[].token`` fields)."""
    logprobs: list[float]
    finish_reason: FinishReason


ModelCall = Callable[[list[Message], list[dict[str, Any]] | None], Awaitable[Sampled]]
"""The runner's side of a model call: the messages the environment added since the last call
(the whole prompt on the first) and the tools, to the sampled turn."""


@dataclass
class _Completions:
    client: PolicyClient

    async def create(
        self,
        *,
        messages: Sequence[Any],
        model: str = MODEL_NAME,
        tools: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> ChatCompletion:
        """``chat.completions.create``: the model's next turn after ``messages``; sampling is
        the run's ``[sampling]``, so ``sampling`` keys are logged and not used."""
        if sampling:
            log.warning("verifiers.sampling_ignored", keys=sorted(sampling), using="[sampling]")
        return await self.client.complete([dict(m) for m in messages], tools or None)


@dataclass
class _Chat:
    completions: _Completions


@dataclass
class PolicyClient:
    """An OpenAI-compatible async client whose calls go to the run's policy, for one episode.

    It keeps ``state.messages`` (what the model saw and wrote), records tool results and
    malformed calls on ``state``, and remembers the first failure of a model call
    (:attr:`failure`), which verifiers would otherwise turn into its own ``ModelError``.
    """

    state: EpisodeState
    model: ModelCall
    rewritten: bool = False
    """The environment sent a history that differs from what the model wrote or saw."""
    failure: Exception | None = None
    calls: int = 0
    chat: _Chat = field(init=False)

    def __post_init__(self) -> None:
        self.chat = _Chat(_Completions(self))

    async def close(self) -> None:
        """Nothing to release: the pool is the run's."""

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> ChatCompletion:
        from openai.types.chat import ChatCompletion

        new = self.absorb(messages)
        try:
            sampled = await self.model(new, tools)
        except Exception as exc:
            self.failure = self.failure or exc
            raise
        self.calls += 1
        parsed = sampled.parsed
        for err in parsed.errors:
            self.state.bad_calls += 1
            call = ToolCall(id="", name=MALFORMED_CALL, arguments=err.raw)
            self.state.tool_results.append((call, "", err.message))
        message = to_openai_message(parsed)
        if parsed.errors:  # an OpenAI server leaves a block it cannot parse in the content
            text = [parsed.content, *(e.raw for e in parsed.errors)]
            message["content"] = "\n".join(t for t in text if t)
        self.state.messages.append(message)
        finish = "tool_calls" if parsed.tool_calls else sampled.finish_reason
        n, m = len(sampled.prompt_token_ids), len(sampled.token_ids)
        return ChatCompletion.model_validate(
            {
                "id": f"sprawl-{self.calls}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL_NAME,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop" if finish in ("abort", "error") else finish,
                        "message": message,
                        "logprobs": {
                            "content": [
                                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(sampled.tokens, sampled.logprobs, strict=True)
                            ]
                        },
                        "token_ids": sampled.token_ids,
                    }
                ],
                "prompt_token_ids": sampled.prompt_token_ids,
                "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
            }
        )

    def absorb(self, messages: list[dict[str, Any]]) -> list[Message]:
        """The messages of ``messages`` past the episode's history, added to it (the first
        call's are the prompt); a history that differs sets :attr:`rewritten`."""
        known = self.state.messages
        msgs = [_clean(m) for m in messages]
        common = next(
            (i for i, (a, b) in enumerate(zip(known, msgs, strict=False)) if _key(a) != _key(b)),
            min(len(known), len(msgs)),
        )
        if not self.calls:
            new = msgs
        elif common == len(known):
            new = msgs[common:]
        else:  # rewritten: the tokens keep what the model saw; the messages after its turn follow
            self.rewritten = True
            last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
            new = msgs[max(last + 1, common) :]
        calls = {
            c["id"]: c["function"]
            for m in [*known, *new]
            for c in m.get("tool_calls") or []
            if isinstance(c, dict) and "id" in c and isinstance(c.get("function"), dict)
        }
        for m in new:
            fn = calls.get(m.get("tool_call_id", ""))
            if m.get("role") != "tool" or fn is None:
                continue
            m.setdefault("name", fn["name"])  # templates that look a tool message's function up
            call = ToolCall(id=m["tool_call_id"], name=fn["name"], arguments=fn["arguments"])
            self.state.tool_results.append((call, _text(m.get("content")), None))
        self.state.messages.extend(new)
        return new


def _clean(message: dict[str, Any]) -> Message:
    """An OpenAI message without the keys verifiers sets to None."""
    return {k: v for k, v in message.items() if v is not None}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return json.dumps(content, sort_keys=True, default=str)


def _key(message: Message) -> tuple[Any, ...]:
    """What makes two messages the same turn (content, calls and their parsed arguments)."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = fn.get("arguments")
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return (
        message.get("role"),
        _text(message.get("content") or ""),
        message.get("reasoning_content") or "",
        tuple(calls),
        message.get("tool_call_id"),
    )


def verifiers_client(client: PolicyClient) -> Any:
    """verifiers' ``OpenAIChatCompletionsClient`` around ``client``, calling
    ``client.chat.completions.create`` (verifiers posts raw HTTP otherwise)."""
    from verifiers.clients import OpenAIChatCompletionsClient

    class _Client(OpenAIChatCompletionsClient):  # type: ignore[misc]
        async def get_native_response(
            self,
            prompt: list[dict[str, Any]],
            model: str,
            sampling_args: dict[str, Any],
            tools: list[dict[str, Any]] | None = None,
            **kwargs: Any,
        ) -> ChatCompletion:
            client.state.data[STATE_KEY] = kwargs.get("state")  # scored if the episode is cut short
            return await client.chat.completions.create(
                messages=prompt, model=model, tools=tools, **sampling_args
            )

    return _Client(client)
