"""A request of several choices one of which fails: the others are answered whole and the failed
one carries its error (#42 defect 5: the whole request was 503) — in the reference engine's batch
and on each of the lane's routes. A sidecar's fan-out to an external engine: test_backends.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from policies.board import Board
from policies.errors import EngineError
from policies.serve import decode
from policies.serve.engine import Engine
from policies.wire.lane import GenerateRequest
from tests.support.boards import engine, tiny_board

NAN = "the model produced NaN logits"


def fail_rows(monkeypatch: pytest.MonkeyPatch, seeds: set[int], after: int) -> None:
    """Sampling a row seeded with one of ``seeds`` raises as NaN logits do, once the row holds
    ``after`` tokens; every other row samples as before."""
    sample = decode.sample_token
    taken: dict[int, int] = {}

    def failing(
        logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
    ) -> tuple[int, float]:
        if gen.initial_seed() in seeds:
            taken[id(gen)] = taken.get(id(gen), 0) + 1
            if taken[id(gen)] > after:
                raise EngineError(NAN)
        return sample(logits, temperature, top_k, top_p, gen)

    monkeypatch.setattr(decode, "sample_token", failing)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = Engine(tiny_model_dir)
    eng.activate(load_file(tiny_model_dir / "model.safetensors"), version=0)
    eng.eos_ids = set()  # every row runs to max_tokens unless it fails
    yield eng
    eng.close()


def _request(**kw: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"prompt_token_ids": [5, 6, 7], "max_tokens": 6, **kw})


def test_a_row_that_fails_mid_decode_leaves_the_other_rows_whole(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tiny_engine.generate(_request(n=3, seed=100))
    fail_rows(monkeypatch, {101}, after=2)
    first, failed, third = tiny_engine.generate(_request(n=3, seed=100))
    for got, want in ((first, whole[0]), (third, whole[2])):  # untouched by their sibling's failure
        assert got.model_dump(exclude={"logprobs"}) == want.model_dump(exclude={"logprobs"})
        # the same tokens; log probs to float32 rounding, as the rows left decode as a batch of 2,
        # not 3, and a CPU matmul may round a row differently at another batch size
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs))
    assert (failed.index, failed.finish_reason) == (1, "error")
    assert failed.token_ids == whole[1].token_ids[:2]  # what it sampled before it failed
    assert failed.logprobs == whole[1].logprobs[:2]
    assert failed.error is not None
    assert failed.error.model_dump() == {
        "type": "engine_unavailable",
        "message": f"generation failed: {NAN}",
    }
    fail_rows(monkeypatch, {200, 201}, after=1)
    with pytest.raises(EngineError, match=NAN):  # no row left: the request has failed
        tiny_engine.generate(_request(n=2, seed=200))


@pytest.mark.anyio
async def test_every_route_answers_a_failed_choice_beside_the_others(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    board: Board = tiny_board(tmp_path, tiny_model_dir)
    fail_rows(monkeypatch, {101}, after=0)  # choice 1 of a request seeded 100: its first token
    sampling = {"n": 2, "seed": 100, "max_tokens": 4}
    routes: list[tuple[str, dict[str, Any]]] = [
        ("/v1/generate", {"prompt_token_ids": [5, 6, 7], **sampling}),
        ("/v1/completions", {"prompt": [5, 6, 7], **sampling}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **sampling}),
    ]
    async with engine(board) as url, aiohttp.ClientSession() as s:
        for route, body in routes:
            async with s.post(f"{url}{route}", json=body) as r:
                assert r.status == 200, route
                ok, failed = (await r.json())["choices"]
            assert ok["finish_reason"] in ("stop", "length"), route
            assert ok["token_ids"], route
            assert "error" not in ok
            assert (failed["finish_reason"], failed["token_ids"]) == ("error", []), route
            assert failed["error"] == {
                "type": "engine_unavailable",
                "message": f"generation failed: {NAN}",
            }
        alone = {"prompt_token_ids": [5, 6, 7], "seed": 101, "max_tokens": 4}
        async with s.post(f"{url}/v1/generate", json=alone) as r:
            assert r.status == 503  # its only choice failed: the engine failed the request
            assert (await r.json())["error"]["type"] == "engine_unavailable"
