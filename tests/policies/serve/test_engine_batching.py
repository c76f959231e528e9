"""The batched reference engine: per-request semantics under batching, joins, leaves, pauses."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from structlog.testing import capture_logs

from policies.codec import apply_patch, encode_patch
from policies.serve.engine import Engine
from policies.serve.sampling import sample_token
from policies.serve.types import Generation, OutOfBounds
from policies.wire.lane import GenerateRequest, VersionBounds
from tests.support.waiting import until_sync


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = Engine(tiny_model_dir)
    eng.activate(load_file(tiny_model_dir / "model.safetensors"), version=0)
    eng.eos_ids = set()  # random weights: let requests run to max_tokens unless told to stop
    yield eng
    eng.close()


def bounded_request(prompt: list[int], **kw: object) -> GenerateRequest:
    return GenerateRequest.model_validate({"prompt_token_ids": prompt, "max_tokens": 12, **kw})


def _submit(engine: Engine, req: GenerateRequest) -> concurrent.futures.Future[Generation]:
    return engine.batcher.submit(req, *engine.validate(req))


def _wait_steps(engine: Engine, n: int) -> None:
    """Until the engine has taken ``n`` more decode steps (its own tick)."""
    target = engine.batcher.steps + n
    until_sync(lambda: engine.batcher.steps >= target, f"{n} decode steps", timeout_s=30)


PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 212))]


def test_batched_requests_match_each_request_alone(engine: Engine) -> None:
    temps, budgets = [0.0, 1.0, 0.7, 1.0], [12, 5, 20, 9]
    reqs = [
        bounded_request(p, temperature=t, seed=i, max_tokens=m)
        for i, (p, t, m) in enumerate(zip(PROMPTS, temps, budgets, strict=True))
    ]
    alone = [engine.generate(r) for r in reqs]
    steps0 = engine.batcher.steps
    futs = [_submit(engine, r) for r in reqs]
    together = [f.result(timeout=60).choices for f in futs]
    for a, b in zip(alone, together, strict=True):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        for ca, cb in zip(a, b, strict=True):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)
            assert len(cb.token_ids) == len(cb.logprobs)
    # they really shared decode steps: far fewer steps than tokens generated
    total = sum(len(c.token_ids) for cs in together for c in cs)
    assert engine.batcher.steps - steps0 < total // 2


def test_a_request_joining_mid_flight_gets_its_own_answer(engine: Engine) -> None:
    late = bounded_request(PROMPTS[1], seed=9, temperature=1.0, max_tokens=10)
    expected = engine.generate(late)
    long = _submit(engine, bounded_request(PROMPTS[0], seed=1, temperature=1.0, max_tokens=120))
    _wait_steps(engine, 10)
    got = _submit(engine, late).result(timeout=60).choices
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert not long.done()  # the late one joined and left while the long one ran
    assert len(long.result(timeout=60).choices[0].token_ids) == 120


def test_choice_i_uses_seed_plus_i(engine: Engine) -> None:
    many = engine.generate(bounded_request(PROMPTS[3], n=3, seed=40, temperature=1.0))
    for i, choice in enumerate(many):
        single = engine.generate(bounded_request(PROMPTS[3], n=1, seed=40 + i, temperature=1.0))[0]
        assert choice.index == i
        assert choice.token_ids == single.token_ids


def test_stop_token_ends_the_choice_and_is_kept(engine: Engine) -> None:
    free = engine.generate(bounded_request(PROMPTS[2], temperature=0.0, max_tokens=12))[0]
    assert free.finish_reason == "length"
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    stopped = engine.generate(bounded_request(PROMPTS[2], temperature=0.0, stop_token_ids=[stop]))[
        0
    ]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_logprobs_are_of_the_sampled_distribution(engine: Engine) -> None:
    # top_k=1 leaves one token: it is sampled with probability 1, log prob 0
    out = engine.generate(bounded_request(PROMPTS[0], temperature=1.0, top_k=1, seed=3))[0]
    assert out.logprobs == pytest.approx([0.0] * len(out.logprobs), abs=1e-6)
    greedy = engine.generate(bounded_request(PROMPTS[0], temperature=0.0))[0]
    assert out.token_ids == greedy.token_ids
    assert all(lp < 0 for lp in greedy.logprobs)


def test_cancelled_request_leaves_the_batch(engine: Engine) -> None:
    doomed = _submit(engine, bounded_request(PROMPTS[0], max_tokens=2000, seed=1))
    other = _submit(engine, bounded_request(PROMPTS[1], max_tokens=30, seed=2))
    _wait_steps(engine, 3)
    assert doomed.cancel()
    assert len(other.result(timeout=60).choices[0].token_ids) == 30
    _until(lambda: engine.batcher.active_rows == 0)


def _until(check: Callable[[], bool]) -> None:
    until_sync(check, "the engine's state", timeout_s=30)


def test_a_cancelled_request_frees_its_rows_or_its_queue_place_at_once(engine: Engine) -> None:
    batcher = engine.batcher
    before = batcher.cancelled
    with capture_logs() as logs:
        big = _submit(engine, bounded_request(PROMPTS[0], n=60, max_tokens=2000, seed=1))
        _until(lambda: batcher.active_rows == 60)
        queued = _submit(engine, bounded_request(PROMPTS[1], n=10, seed=2))  # 60 + 10 > 64 rows
        _wait_steps(engine, 2)
        assert batcher.queued == 1
        assert queued.cancel()
        _until(lambda: batcher.queued == 0)  # it leaves the queue while the big one decodes
        assert batcher.active_rows == 60
        assert big.cancel()
        _until(lambda: batcher.active_rows == 0)
    assert batcher.cancelled == before + 2
    cancelled = [e for e in logs if e["event"] == "generation_cancelled"]
    assert [e["rows"] for e in cancelled] == [0, 60]
    assert 60 <= cancelled[1]["tokens"] < 60 * 2000


def test_pause_mode_resumes_in_flight_on_new_weights(engine: Engine) -> None:
    view = {k: v.clone() * 0.5 for k, v in engine.live_tensors().items()}
    old = {k: v.clone() for k, v in engine.live_tensors().items()}
    fut = _submit(engine, bounded_request(PROMPTS[0], max_tokens=200, seed=5))
    _wait_steps(engine, 5)
    done = engine.activate(view, version=engine.version + 1, mode="pause")  # type: ignore[operator]
    gen = fut.result(timeout=60)
    assert gen.end == gen.start + 1  # type: ignore[operator]
    assert len(gen.choices[0].token_ids) == 200
    assert done.held_s >= 0
    assert done.wait_s >= 0
    engine.activate(old, version=engine.version + 1, mode="pause")  # type: ignore[operator]


def test_wait_mode_drains_in_flight_first(engine: Engine) -> None:
    same = dict(engine.live_tensors())
    fut = _submit(engine, bounded_request(PROMPTS[0], max_tokens=60, seed=5))
    _wait_steps(engine, 3)
    v = engine.version
    assert v is not None
    engine.activate(same, version=v + 1, mode="wait")
    assert fut.done()  # it finished before the activation returned
    gen = fut.result()
    assert (gen.start, gen.end) == (v, v)


def test_bounds_are_checked_when_the_request_joins(engine: Engine) -> None:
    v = engine.version
    assert v is not None
    ok = _submit(engine, bounded_request([1, 2], policy_version={"min": v, "max": v})).result(
        timeout=60
    )
    assert (ok.start, ok.end) == (v, v)
    with pytest.raises(OutOfBounds):
        _submit(engine, bounded_request([1, 2], policy_version=VersionBounds(min=v + 1))).result(
            timeout=60
        )


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**31),
)
def test_sample_token_reports_the_truncated_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    x = torch.tensor(logits)
    token, logprob = sample_token(x, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    assert 0 <= token < len(logits)
    assert logprob <= 1e-6
    full = float(torch.log_softmax(x / temperature, -1)[token])
    assert logprob >= full - 1e-5  # truncation only moves mass onto the kept tokens
    if top_k:
        assert (x > x[token]).sum() < top_k  # the token is inside the top k


def test_patched_engine_matches_a_fresh_load(tiny_model_dir: Path) -> None:
    """Outputs after N in-place patches are token- and logprob-identical to a fresh load."""
    view = {
        k: v.to(torch.bfloat16) for k, v in load_file(tiny_model_dir / "model.safetensors").items()
    }
    live = Engine(tiny_model_dir, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    try:
        live.activate(view, version=0)
        state = {k: v.clone() for k, v in view.items()}
        for v in range(1, 5):
            target = {}
            for name, t in state.items():
                bits = t.clone().view(torch.int16).reshape(-1)
                idx = torch.randint(0, bits.numel(), (max(1, bits.numel() // 100),), generator=gen)
                bits[idx] += 1
                target[name] = bits.view(torch.bfloat16).reshape(t.shape)
            patch = encode_patch(state, target)
            live.apply(partial(apply_patch, patch=patch), version=v, mode="pause")
            state = target
        fresh = Engine(tiny_model_dir, dtype=torch.bfloat16)
        try:
            fresh.activate(state, version=4)
            req = bounded_request(PROMPTS[1], seed=3, temperature=1.0, max_tokens=16, n=2)
            assert live.generate(req) == fresh.generate(req)
            for name, t in live.live_tensors().items():
                assert torch.equal(t, state[name]), name
        finally:
            fresh.close()
    finally:
        live.close()


def test_a_failed_forward_fails_every_joining_request_instead_of_hanging() -> None:
    class Broken(torch.nn.Module):
        def forward(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("forward exploded")

    from policies.errors import EngineError
    from policies.serve.decode import DecodeBatcher
    from policies.wire.lane import GenerateRequest

    sched = DecodeBatcher(Broken(), device=torch.device("cpu"), max_rows=8)
    futures = [
        sched.submit(GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2, seed=i), 2, frozenset())
        for i in range(3)
    ]
    for future in futures:
        with pytest.raises(EngineError, match="forward exploded"):
            future.result(timeout=30)
    sched.close()


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-300, 1.0), (1e-40, 1.0), (1.0, 1e-300), (1.0, 1e-46)]
)
def test_sampling_fields_that_round_to_zero_are_their_limit(
    engine: Engine, temperature: float, top_p: float
) -> None:
    greedy = engine.generate(bounded_request(PROMPTS[1], temperature=0.0, seed=0))
    good = [
        _submit(engine, bounded_request(p, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)
    ]
    odd = engine.generate(bounded_request(PROMPTS[1], temperature=temperature, top_p=top_p, seed=0))
    assert [c.token_ids for c in odd] == [c.token_ids for c in greedy]
    assert all(math.isfinite(lp) for c in odd for lp in c.logprobs)
    for f in good:
        assert len(f.result(timeout=60).choices[0].token_ids) == 12


def test_a_failing_request_fails_alone() -> None:
    """A request whose join fails (a seed that is not a number) or whose row fails mid-decode
    (NaN logits) fails with EngineError; requests decoding beside it finish."""
    from types import SimpleNamespace

    from policies.errors import EngineError
    from policies.serve.decode import DecodeBatcher

    vocab, poison = 16, 15

    class Counter(torch.nn.Module):
        """Greedy continues ``t → t + 1``; a row whose last token is ``poison`` gets NaN."""

        def forward(
            self,
            ids: torch.Tensor,
            cache: Any = None,
            **_: object,  # a DynamicCache
        ) -> SimpleNamespace:
            b, t = ids.shape
            new = torch.zeros(b, 1, t, 1)
            keys = new if cache is None else torch.cat([cache.layers[0].keys, new], 2)
            logits = torch.nn.functional.one_hot((ids + 1) % vocab, vocab).float() * 5
            logits[ids == poison] = float("nan")
            layer = SimpleNamespace(keys=keys, values=keys)
            return SimpleNamespace(logits=logits, cache=SimpleNamespace(layers=[layer]))

    sched = DecodeBatcher(Counter(), device=torch.device("cpu"), max_rows=8)
    try:

        def req(prompt: list[int]) -> GenerateRequest:
            return GenerateRequest(prompt_token_ids=prompt, max_tokens=6, temperature=0.0)

        sched.version = 0
        with sched.quiesce("pause"):  # all four join at the same step boundary
            good = [sched.submit(req([i]), 6, frozenset()) for i in (0, 3)]
            nan = sched.submit(req([13]), 6, frozenset())  # samples 14, then 15, then NaN
            bad_seed = req([1]).model_copy(update={"seed": "x"})  # past the lane's check
            seeded = sched.submit(bad_seed, 6, frozenset())
        with pytest.raises(EngineError, match="NaN logits"):
            nan.result(timeout=30)
        with pytest.raises(EngineError, match="generation failed"):
            seeded.result(timeout=30)
        assert [f.result(timeout=30).choices[0].token_ids for f in good] == [
            [1, 2, 3, 4, 5, 6],
            [4, 5, 6, 7, 8, 9],
        ]
    finally:
        sched.close()


def test_the_lane_refuses_a_seed_outside_int64() -> None:
    from pydantic import ValidationError

    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(ValidationError, match="seed"):
            bounded_request([1], seed=seed)
    assert bounded_request([1], seed=-(2**63)).seed == -(2**63)
