"""llama.cpp behind the sidecar, live: a real ``llama-server`` (scripts/build-llama-server.sh,
cached) serving real board versions of sprawl's tiny model, compared with fresh servers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from policies.board import Board, failpoints
from policies.board.gguf import materialize_gguf
from policies.serve.backends.llamacpp_wire import (
    EXACT_FLAGS,
    LlamaOptions,
    completion_body,
    sampled_logprob,
)
from policies.serve.sampling import sample_token
from policies.wire.lane import GenerateRequest
from tests.support.boards import adam_like_step
from tests.support.lane import standalone
from tests.support.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[3]
CTX = 1024
PROMPTS = [[1, 100, 200, 300, 2, 1], [1, 42, 7, 1999, 2, 1, 5]]
SAMPLED = {"temperature": 1.0, "top_p": 0.5, "seed": 1234, "n": 4, "max_tokens": 48}
State = dict[str, torch.Tensor]


def step(state: State, seed: int) -> State:
    """5% of the values move ±1 ulp, as Adam moves them."""
    return adam_like_step(state, seed=seed, density=0.05)


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """The cached build (the script builds it once, offline, and prints its path)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/build-llama-server.sh")],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def published(tmp_path: Path, tiny_model_dir: Path) -> tuple[Board, State]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state = {
        k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    board = Board(str(tmp_path / "board"), "run")
    board.create(tiny_model_dir)
    board.publish(0, state, view_name="bfloat16")
    return board, state


def sidecar(
    board: Board, server: Path, island: Path, *, prewarm: bool = True
) -> contextlib.AbstractAsyncContextManager[str]:
    return standalone(
        board,
        "llamacpp",
        poll_interval_s=3600,  # versions arrive by notify only
        materialize_dir=island,
        llama=LlamaOptions(server=server, ctx_size=CTX, extra_args=("-t", "2"), prewarm=prewarm),
    )


@asynccontextmanager
async def fresh_engine(server: Path, gguf: Path) -> AsyncIterator[str]:
    """A plain llama-server on ``gguf`` (same flags), for parity."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    cmd = [str(server), "-m", str(gguf), "--port", str(port), "-c", str(CTX), *EXACT_FLAGS]
    cmd += ["--no-webui", "-t", "2"]
    async with await anyio.open_process(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:

                async def healthy() -> bool:
                    try:
                        async with s.get(f"{url}/health") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await until(healthy, f"llama-server healthy at {url}", timeout_s=30)
            yield url
        finally:
            proc.terminate()
            await proc.wait()


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def wait_applied(s: aiohttp.ClientSession, url: str, version: int) -> None:
    await post(s, f"{url}/v1/policy/notify", {})

    async def applied() -> bool:
        async with s.get(f"{url}/v1/policy") as r:
            return bool((await r.json())["applied_version"] == version)

    await until(applied, f"version {version} applied", timeout_s=30)


async def metric(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def until_counted(s: aiohttp.ClientSession, url: str, name: str) -> None:
    """Until the sidecar's counter ``name`` is at least 1 (its /metrics, polled)."""
    await until(lambda: metric(s, url, name), f"{name} counted")


async def fresh_answers(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[tuple[list[int], list[float | None]]]:
    """What a fresh server samples for a lane request: per choice, ids and aligned log probs."""
    req = GenerateRequest.model_validate(body)
    out = []
    for i in range(req.n):
        seed = None if req.seed is None else req.seed + i
        wire = completion_body(req, req.prompt_token_ids, req.max_tokens, seed)
        status, answer = await post(s, f"{url}/completion", wire)
        assert status == 200, answer
        entries, aligned, j = answer["completion_probabilities"], [], 0
        for t in answer["tokens"]:
            if j < len(entries) and entries[j]["id"] == t:
                e = entries[j]
                aligned.append(e["logprob"] if req.temperature == 0 else math.log(e["prob"]))
                j += 1
            else:
                aligned.append(None)  # llama.cpp's UTF-8 gap: the sidecar fills these
        out.append((answer["tokens"], aligned))
    return out


def reference_logprobs(
    model_dir: Path, state: State, prompt: list[int], tokens: list[int], req: GenerateRequest
) -> list[float]:
    """Teacher-forced log probs of ``tokens`` under the reference rule, in torch."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    raw = torch.log_softmax(logits, -1)
    return [
        sampled_logprob(raw[len(prompt) - 1 + i].tolist(), t, req.temperature, req.top_k, req.top_p)
        for i, t in enumerate(tokens)
    ]


def test_sampled_logprob_is_the_reference_rule() -> None:
    g = torch.Generator().manual_seed(0)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (1.0, 0, 0.5), (0.7, 20, 0.9), (2.0, 5, 1.0)]:
        for _ in range(20):
            logits = torch.randn(300, generator=g) * 3
            token, logp = sample_token(logits, temperature, top_k, top_p, g)
            raw = torch.log_softmax(logits, -1).tolist()
            assert sampled_logprob(raw, token, temperature, top_k, top_p) == pytest.approx(
                logp, abs=1e-5
            )


async def test_versions_follow_the_board_exactly(
    published: tuple[Board, State], llama_server: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    board, state = published
    island = tmp_path / "island"
    greedy = [{"prompt_token_ids": p, "max_tokens": 32, "temperature": 0.0} for p in PROMPTS]
    sampled = {"prompt_token_ids": PROMPTS[0], **SAMPLED}
    gaps = 0
    previous: list[float] | None = None
    async with sidecar(board, llama_server, island) as url, aiohttp.ClientSession() as s:
        await wait_applied(s, url, 0)
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == CTX  # the engine's n_ctx
        for version in range(4):
            if version:
                state = step(state, version)
                board.publish(version, state, view_name="bfloat16")
                before = await metric(s, url, "sprawl_board_bytes_read_total")
                await wait_applied(s, url, version)
                read = await metric(s, url, "sprawl_board_bytes_read_total") - before
                patch = board.manifest(version).bytes
                assert board.manifest(version).kind == "delta"
                assert read <= 2 * patch, (read, patch)
            gguf = materialize_gguf(board, version, tmp_path / f"fresh-{version}.gguf")
            assert (island / f"v{version:08d}.gguf").read_bytes() == gguf.read_bytes()
            async with fresh_engine(llama_server, gguf) as fresh:
                for body in [*greedy, sampled]:
                    status, got = await post(s, f"{url}/v1/generate", body)
                    assert status == 200, got
                    assert got["policy_version"] == {"start": version, "end": version}
                    want = await fresh_answers(s, fresh, body)
                    for choice, (tokens, logprobs) in zip(got["choices"], want, strict=True):
                        assert choice["token_ids"] == tokens
                        assert len(choice["logprobs"]) == len(tokens)
                        for lp, ref in zip(choice["logprobs"], logprobs, strict=True):
                            if ref is not None:
                                assert lp == ref  # bit-identical: same weights, same engine
                            gaps += ref is None
                    if body is greedy[0]:
                        lps = got["choices"][0]["logprobs"]
                        assert lps != previous  # each version really serves new weights
                        previous = lps
            # the log probs (gap fills included) are those of the distribution sampled
            req = GenerateRequest.model_validate(sampled)
            status, got = await post(s, f"{url}/v1/generate", sampled)
            for choice in got["choices"]:
                ref = reference_logprobs(
                    tiny_model_dir, state, PROMPTS[0], choice["token_ids"], req
                )
                assert choice["logprobs"] == pytest.approx(ref, abs=1e-4)
        # bounds and stamps
        status, body = await post(
            s, f"{url}/v1/generate", {**greedy[0], "policy_version": {"min": 4}}
        )
        assert (status, body["error"]["type"]) == (409, "policy_version_unavailable")
        assert body["error"]["applied_version"] == 3
        status, body = await post(
            s, f"{url}/v1/generate", {**greedy[0], "policy_version": {"max": 2}}
        )
        assert status == 409
        # limits come from the engine: over-long prompts and foreign ids are the lane's 400
        status, body = await post(
            s, f"{url}/v1/generate", {"prompt_token_ids": [5] * CTX, "max_tokens": 4}
        )
        assert (status, body["error"]["param"]) == (400, "prompt_token_ids")
        status, body = await post(
            s, f"{url}/v1/generate", {"prompt_token_ids": [5] * (CTX - 3), "max_tokens": 50}
        )
        assert status == 200
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert len(body["choices"][0]["token_ids"]) <= 3
        status, body = await post(s, f"{url}/v1/generate", {"prompt_token_ids": [1, 99999]})
        assert (status, body["error"]["param"]) == (400, "prompt_token_ids")
        # stop ids are enforced by the sidecar: cut after the first one, which is kept
        status, full = await post(s, f"{url}/v1/generate", greedy[1])
        tokens = full["choices"][0]["token_ids"]
        stop = tokens[5]
        status, cut = await post(s, f"{url}/v1/generate", {**greedy[1], "stop_token_ids": [stop]})
        first = tokens.index(stop)
        assert cut["choices"][0]["token_ids"] == tokens[: first + 1]
        assert cut["choices"][0]["logprobs"] == full["choices"][0]["logprobs"][: first + 1]
        assert cut["choices"][0]["finish_reason"] == "stop"
    assert gaps > 0  # the UTF-8 gap was exercised (and filled)


async def test_damaged_patch_is_never_activated(
    published: tuple[Board, State],
    llama_server: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    board, state = published
    probe = {"prompt_token_ids": PROMPTS[0], **SAMPLED}
    async with (
        sidecar(board, llama_server, tmp_path / "island") as url,
        aiohttp.ClientSession() as s,
    ):
        state = step(state, 1)
        board.publish(1, state, view_name="bfloat16")
        await wait_applied(s, url, 1)
        _, before = await post(s, f"{url}/v1/generate", probe)
        rule = {"site": "board.write", "match": "*/versions/00000002/*.patch"}
        monkeypatch.setenv(failpoints.ENV, json.dumps([{**rule, "action": "corrupt", "times": 9}]))
        failpoints.reset()
        try:
            board.publish(2, step(state, 2), view_name="bfloat16")
        finally:
            monkeypatch.delenv(failpoints.ENV)
            failpoints.reset()
        await post(s, f"{url}/v1/policy/notify", {})
        with anyio.fail_after(30):
            await until_counted(s, url, "sprawl_version_failures_total")
        async with s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 1
        status, after = await post(s, f"{url}/v1/generate", probe)
        assert status == 200
        assert after["choices"] == before["choices"]  # bit-identical: still version 1
        assert after["policy_version"] == {"start": 1, "end": 1}
        assert not (tmp_path / "island" / "v00000002.gguf").exists()


@pytest.mark.parametrize("prewarm", [True, False], ids=["prewarm", "restart"])
async def test_engine_that_fails_a_version_keeps_serving_the_old_one(
    published: tuple[Board, State], llama_server: Path, tmp_path: Path, prewarm: bool
) -> None:
    board, state = published
    wrapper = tmp_path / "llama-server"  # a server that cannot load version 1's file
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *v00000001.gguf*) exit 3;; esac\nexec {llama_server} "$@"\n'
    )
    wrapper.chmod(0o755)
    probe = {"prompt_token_ids": PROMPTS[0], **SAMPLED}
    island = tmp_path / "island"
    async with (
        sidecar(board, wrapper, island, prewarm=prewarm) as url,
        aiohttp.ClientSession() as s,
    ):
        await wait_applied(s, url, 0)
        _, before = await post(s, f"{url}/v1/generate", probe)
        board.publish(1, step(state, 1), view_name="bfloat16")
        await post(s, f"{url}/v1/policy/notify", {})
        with anyio.fail_after(30):
            await until_counted(s, url, "sprawl_activation_failures_total")
        async with s.get(f"{url}/v1/policy") as r:
            assert (await r.json())["applied_version"] == 0
        status, after = await post(s, f"{url}/v1/generate", probe)
        assert status == 200
        assert after["choices"] == before["choices"]  # bit-identical: still version 0
        assert after["policy_version"] == {"start": 0, "end": 0}
        assert (island / "v00000000.gguf").exists()


async def test_engine_killed_mid_request_then_recovers(
    published: tuple[Board, State], llama_server: Path, tmp_path: Path
) -> None:
    board, _ = published
    body = {"prompt_token_ids": PROMPTS[1], **SAMPLED}
    async with (
        sidecar(board, llama_server, tmp_path / "island") as url,
        aiohttp.ClientSession() as s,
    ):
        await wait_applied(s, url, 0)
        _, before = await post(s, f"{url}/v1/generate", body)
        (engine,) = [
            p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"
        ]
        engine.send_signal(signal.SIGSTOP)  # the request below is surely in flight when killed
        answers: list[tuple[int, Any]] = []

        async def send() -> None:
            answers.append(await post(s, f"{url}/v1/generate", body))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await until(  # the sidecar serves it, waiting on the stopped engine
                lambda: metric(s, url, "sprawl_lane_inflight"), "the request in flight"
            )
            os.kill(engine.pid, signal.SIGKILL)
        ((status, answer),) = answers
        assert (status, answer["error"]["type"]) == (503, "engine_unavailable")

        async def served() -> Any:
            code, again = await post(s, f"{url}/v1/generate", body)
            assert code in (200, 503), again
            return again if code == 200 else None

        # the next requests restart it on the live version
        after = await until(served, "an answer from the restarted engine", timeout_s=30)
        assert after["choices"] == before["choices"]
        assert after["policy_version"] == {"start": 0, "end": 0}
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"]
