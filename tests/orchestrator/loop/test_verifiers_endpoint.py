"""The endpoint verifiers' train client calls (:mod:`orchestrator.loop.verifiers_endpoint`), over
a real aiohttp server on loopback, with the runner's model call scripted: the routes and body
verifiers sends, the version stamps, the token-exact sequence, and every refusal."""

from __future__ import annotations

import io
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from orchestrator.errors import EndpointError
from orchestrator.loop.verifiers_endpoint import (
    MAX_PROMPT_TOKENS,
    SESSION_HEADER,
    EpisodeCalls,
    PolicyEndpoint,
)
from orchestrator.types import SamplingParams, Segment
from policies.wire.lane import GenerateChoice, VersionBounds, VersionStamp

pytestmark = pytest.mark.anyio


class _Trace:
    def __init__(self, trace_id: str) -> None:
        self.id = trace_id


class ScriptedCall:
    """``EpisodeRunner._call``: samples ``[7, 8, 2]``, stamps version 4..5, records what it got."""

    def __init__(self, fail: bool = False, full: bool = False) -> None:
        self.fail, self.full = fail, full
        self.seen: list[tuple[list[int], VersionBounds, int | None, list[int]]] = []

    async def __call__(
        self,
        ids: list[int],
        rec: dict[str, Any],
        bounds: Any,
        seed: int | None,
        *,
        max_tokens: int | None,
        stop_token_ids: list[int],
    ) -> GenerateChoice | None:
        self.seen.append((list(ids), bounds(), max_tokens, list(stop_token_ids)))
        if self.fail:
            raise EndpointError("e0", "HTTP 500: boom")
        if self.full:
            return None
        choice = GenerateChoice(
            index=0, token_ids=[7, 8, 2], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop"
        )
        rec["segments"].append(
            Segment(
                turn=len(rec["segments"]),
                prompt_len=len(ids),
                token_ids=choice.token_ids,
                logprobs=choice.logprobs,
                finish_reason="stop",
                policy_version=VersionStamp(start=4, end=5),
                bounds=bounds(),
                endpoint="e0",
                latency_s=0.0,
                sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8),
            )
        )
        ids.extend(choice.token_ids)
        return choice


def _calls(call: ScriptedCall, max_turns: int = 4) -> EpisodeCalls:
    rec: dict[str, Any] = {"id": "ep-1", "token_ids": [], "prompt_len": 0, "segments": []}
    return EpisodeCalls(rec, lambda: VersionBounds(min=3), 11, max_turns, call)


@pytest.fixture
async def served() -> AsyncIterator[tuple[PolicyEndpoint, str]]:
    endpoint = PolicyEndpoint("sprawl-policy", max_context=512)
    async with endpoint.serve() as url:
        yield endpoint, url


async def _post(
    url: str, body: Any, token: str | None, session: str = "trace-a"
) -> tuple[int, Any]:
    headers = {SESSION_HEADER: session, "Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{url}/inference/v1/generate",
            data=io.BytesIO(json.dumps(body).encode()),
            headers=headers,
        ) as r,
    ):
        return r.status, await r.json()


def _body(ids: list[int], **sampling: Any) -> dict[str, Any]:
    params = {"max_tokens": 6, "stop_token_ids": [2], "logprobs": 1, **sampling}
    return {"model": "sprawl-policy", "token_ids": ids, "sampling_params": params}


async def test_a_call_is_the_runners_with_its_bounds_and_comes_back_stamped(
    served: tuple[PolicyEndpoint, str],
) -> None:
    endpoint, url = served
    call = ScriptedCall()
    calls = _calls(call)
    with endpoint.expecting(calls) as on_trace:
        on_trace(_Trace("trace-a"))
        status, answer = await _post(url, _body([1, 2, 3]), endpoint.token)
    assert status == 200, answer
    assert call.seen == [([1, 2, 3], VersionBounds(min=3), 6, [2])]
    choice = answer["choices"][0]
    assert choice["token_ids"] == [7, 8, 2]
    assert choice["logprobs"]["content"] == [
        {"token": "token_id:7", "logprob": -0.1},
        {"token": "token_id:8", "logprob": -0.2},
        {"token": "token_id:2", "logprob": -0.3},
    ]
    assert answer["prompt_token_ids"] == [1, 2, 3]
    assert answer["policy_version"] == {"start": 4, "end": 5}
    assert calls.rec["prompt_len"] == 3
    assert endpoint.episodes == {}  # the episode's traces are forgotten when it ends


async def test_the_sequence_grows_token_exactly_and_a_rewritten_history_is_refused() -> None:
    call = ScriptedCall()
    calls = _calls(call)
    await calls.generate("t", [1, 2, 3], None, [])
    await calls.generate("t", [1, 2, 3, 7, 8, 2, 9, 10], None, [])  # + the renderer's tokens
    assert calls.rec["token_ids"] == [1, 2, 3, 7, 8, 2, 9, 10, 7, 8, 2]
    assert [s.prompt_len for s in calls.rec["segments"]] == [3, 8]
    with pytest.raises(Exception, match="re-tokenized earlier turns"):
        await calls.generate("t", [1, 2, 3, 7, 99, 2, 9, 10, 7, 8, 2, 5], None, [])
    assert calls.refused is not None
    assert len(call.seen) == 2  # the refused call never reached an engine


async def test_max_turns_the_context_limit_and_a_failed_call_end_the_episodes_calls() -> None:
    calls = _calls(ScriptedCall(), max_turns=1)
    await calls.generate("t", [1], None, [])
    with pytest.raises(Exception, match="max_turns"):
        await calls.generate("t", [1, 7, 8, 2, 5], None, [])
    assert calls.stop == "max_turns"

    calls = _calls(ScriptedCall(full=True))
    with pytest.raises(Exception, match="context limit"):
        await calls.generate("t", [1], None, [])
    assert calls.stop == "context"

    failing = ScriptedCall(fail=True)
    calls = _calls(failing)
    with pytest.raises(Exception, match="model call failed"):
        await calls.generate("t", [1], None, [])
    assert isinstance(calls.failure, EndpointError)
    with pytest.raises(Exception, match="have ended"):
        await calls.generate("t", [1], None, [])
    assert len(failing.seen) == 1


async def test_a_second_agent_is_refused_and_a_retried_agent_starts_over() -> None:
    calls = _calls(ScriptedCall())
    await calls.generate("first", [1, 2], None, [])
    calls.discard(_Trace("first"))  # verifiers retried the agent: a new trace
    await calls.generate("second", [1, 2, 3], None, [])
    assert calls.rec["token_ids"] == [1, 2, 3, 7, 8, 2]
    assert len(calls.rec["segments"]) == 1
    with pytest.raises(Exception, match="second agent"):
        await calls.generate("third", [4], None, [])


@pytest.mark.parametrize(
    ("body", "token", "session", "status", "message"),
    [
        (_body([1]), None, "trace-a", 401, "bearer token"),
        (_body([1]), "wrong", "trace-a", 401, "bearer token"),
        (_body([1]), "TOKEN", "unknown", 404, "no episode in flight"),
        (_body([]), "TOKEN", "trace-a", 400, "token_ids"),
        ({"model": "m", "token_ids": "abc"}, "TOKEN", "trace-a", 400, "token_ids"),
        (_body([1], stop_token_ids=list(range(65))), "TOKEN", "trace-a", 400, "stop_token_ids"),
        (
            {**_body([1]), "content_parts": [{"type": "image_url"}]},
            "TOKEN",
            "trace-a",
            400,
            "multi",
        ),
    ],
)
async def test_bad_calls_are_4xx_naming_what_was_wrong(
    served: tuple[PolicyEndpoint, str],
    body: Any,
    token: str | None,
    session: str,
    status: int,
    message: str,
) -> None:
    endpoint, url = served
    call = ScriptedCall()
    with endpoint.expecting(_calls(call)) as on_trace:
        on_trace(_Trace("trace-a"))
        got, answer = await _post(url, body, endpoint.token if token == "TOKEN" else token, session)
    assert got == status
    assert message in answer["error"]["message"]
    assert call.seen == []


async def test_an_oversized_prompt_is_refused_before_it_is_read(
    served: tuple[PolicyEndpoint, str],
) -> None:
    endpoint, url = served
    with endpoint.expecting(_calls(ScriptedCall())) as on_trace:
        on_trace(_Trace("trace-a"))
        status, answer = await _post(url, _body([1] * (MAX_PROMPT_TOKENS + 1)), endpoint.token)
    assert status in (400, 413)
    assert "token_ids" in answer["error"]["message"] or "over" in answer["error"]["message"]


async def test_models_reports_the_context_limit(served: tuple[PolicyEndpoint, str]) -> None:
    endpoint, url = served
    headers = {"Authorization": f"Bearer {endpoint.token}"}
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models", headers=headers) as r:
        assert r.status == 200
        card = (await r.json())["data"][0]
    assert card == {"id": "sprawl-policy", "object": "model", "max_model_len": 512}


async def test_each_endpoint_of_a_mixture_has_its_own_token_variable() -> None:
    """A mixture serves one endpoint per environment: each client must read its own token (one
    shared variable made every environment but the last answer 401)."""
    first, second = PolicyEndpoint("m", 64), PolicyEndpoint("m", 64)
    async with first.serve(), second.serve():
        assert first.key_var != second.key_var
        assert "API_KEY" in first.key_var  # verifiers' runtimes keep it from their programs
        assert os.environ[first.key_var] == first.token
        assert os.environ[second.key_var] == second.token
    assert first.key_var not in os.environ
    assert second.key_var not in os.environ
