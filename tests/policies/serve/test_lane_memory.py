"""What a hostile request may cost a lane server in memory before it is refused (#42 defect 12).

900 KB text prompts, each answered 400, took an ``orchestrate serve`` process from 0.47 GB to
1.6 GB, four at a time, and left most of it held: the tokenizer's ~400 bytes a token for a prompt
that could never fit, and the refused request's text kept alive by its exception's traceback.
"""

from __future__ import annotations

import contextlib
import json
import random
import string
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from transformers import PreTrainedTokenizerBase

from policies.board import Board
from policies.serve.connections import LaneLimits
from policies.serve.prompt_size import PIECE_CHARS, tokens_over
from tests.support.boards import engine, tiny_board
from tests.support.waiting import until

REPO = Path(__file__).resolve().parents[3]
MB = 1 << 20


def hostile_text(chars: int = 900_000) -> str:
    """Words of 2 to 9 random letters: about 0.75 tokens a character for the tiny model."""
    rnd = random.Random(0)
    words = ["".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(2, 9))) for _ in range(5000)]
    return " ".join(rnd.choices(words, k=chars // 5))[:chars]


class Recording:
    """A tokenizer that records the length of every text it encodes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.encoded: list[int] = []

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.encoded.append(len(text))
        return list(self.tokenizer.encode(text, **kw))


# -- counting a prompt a piece at a time --------------------------------------------------------
def test_a_prompt_that_cannot_fit_is_refused_after_one_piece(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    recording = Recording(tokenizer)
    over = tokens_over(recording, [(hostile_text(), False)], 2048)  # type: ignore[arg-type]
    assert over is not None
    assert over > 2048
    assert len(recording.encoded) == 1
    assert recording.encoded[0] <= PIECE_CHARS
    assert tokens_over(recording, [("short " * 100, False)], 2048) is None  # type: ignore[arg-type]
    assert len(recording.encoded) == 1  # a text of at most one piece is left to the route


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        (hostile_text(120_000), False),
        ("\n\n  ".join(hostile_text(60_000).split(" ")) + "  \n", False),
        ("x" * 100_000, False),  # no whitespace: cut mid-word
        ("e\u0301t\u00e9 \ud55c\uad6d\uc5b4 \U0001f600 " * 12_000, False),  # combining, CJK, emoji
        ("<|im_end|>\n<|im_start|>user " * 4_000, False),  # special tokens' texts
        ("<|im_end|>\n<|im_start|>user " * 4_000, True),  # the same as plain text
    ],
    ids=["words", "whitespace-runs", "one-word", "unicode", "special", "special-as-plain"],
)
def test_the_count_refuses_no_prompt_that_fits(
    tokenizer: PreTrainedTokenizerBase, text: str, plain: bool
) -> None:
    tokens = len(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=plain))
    assert len(text) > 2 * PIECE_CHARS
    assert tokens_over(tokenizer, [(text, plain)], tokens) is None
    over = tokens_over(tokenizer, [(text, plain)], tokens // 2)
    assert over is not None
    assert tokens // 2 < over <= tokens


# -- the lane -----------------------------------------------------------------------------------
@pytest.fixture
def board(tmp_path: Path, tiny_model_dir: Path) -> Board:
    return tiny_board(tmp_path, tiny_model_dir)


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_413_json_unread(board: Board) -> None:
    body = json.dumps({"prompt": "word " * 2000, "max_tokens": 2}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused once read past it
        for i in range(0, len(body), 1024):
            yield body[i : i + 1024]

    async with engine(board, limits=LaneLimits(max_body_bytes=4096)) as url:
        for data in (body, chunked()):
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{url}/v1/completions", data=data) as r,
            ):
                assert (r.status, r.content_type) == (413, "application/json")
                assert await r.json() == {
                    "error": {
                        "type": "request_too_large",
                        "message": "request body is over 4096 bytes (--max-body-bytes)",
                    }
                }
        async with aiohttp.ClientSession() as s:
            small = {"prompt": "word " * 10, "max_tokens": 2}
            async with s.post(f"{url}/v1/completions", json=small) as r:
                assert r.status == 200


@pytest.mark.anyio
async def test_errors_quote_a_long_text_cut_short(board: Board) -> None:
    async with engine(board) as url, aiohttp.ClientSession() as s:
        body = {"prompt": "hi", "stop": [hostile_text(100_000)], "max_tokens": 2}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == "stop"
        assert "(100000 characters) is not one token" in error["message"]
        assert len(error["message"]) < 300  # never the whole string


# -- the serving process under hostile prompts ----------------------------------------------------
def _memory(pid: int) -> dict[str, int]:
    """The process's resident set now (``VmRSS``) and at its peak (``VmHWM``), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


async def _refused(url: str, route: str, body: dict[str, Any], at_once: int) -> None:
    async def one() -> None:
        async with aiohttp.ClientSession() as s, s.post(f"{url}{route}", json=body) as r:
            assert r.status == 400, await r.text()
            assert "the model's context is 2048" in (await r.json())["error"]["message"]

    async with anyio.create_task_group() as tg:
        for _ in range(at_once):
            tg.start_soon(one)


@pytest.mark.slow
@pytest.mark.anyio
async def test_hostile_prompts_cost_the_serving_process_a_bounded_memory(
    tiny_model_dir: Path,
) -> None:
    argv = [sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(tiny_model_dir)]
    argv += ["--port", "0", "--log-format", "json", "--parent-stdin"]
    async with await anyio.open_process(
        argv, cwd=REPO, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL
    ) as proc:
        assert proc.stdout is not None
        ready = b""
        with anyio.fail_after(180):  # the ready line, once the model is loaded
            while not ready.endswith(b"\n"):
                ready += await proc.stdout.receive()
        url = json.loads(ready)["url"]
        warm = {"prompt": "hello there", "max_tokens": 2}
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=warm) as r:
            assert r.status == 200  # tokenizer threads and lazy state exist before the baseline
        baseline = _memory(proc.pid)["VmRSS"]
        with contextlib.suppress(OSError):  # else the peak includes start-up's (tens of MB)
            await anyio.Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # peak := now
        text = hostile_text()
        with anyio.fail_after(300):
            for _ in range(2):
                await _refused(url, "/v1/completions", {"prompt": text, "max_tokens": 4}, 4)
                chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
                await _refused(url, "/v1/chat/completions", chat, 4)
        # the refused requests' memory is back within the bound once they are answered
        await until(
            lambda: _memory(proc.pid)["VmRSS"] - baseline < 200 * MB,
            "the serving process's memory back within 200 MB of its baseline",
            timeout_s=10,
        )
        after = _memory(proc.pid)
        peak, held = after["VmHWM"] - baseline, after["VmRSS"] - baseline
        figures = f"peak +{peak // MB} MB, held +{held // MB} MB over {baseline // MB} MB"
        # counted a piece at a time: +52 MB at the peak, +46 MB held; each prompt encoded whole
        # and kept alive by its traceback: +1389 MB at the peak, +1275 MB held
        assert peak < 300 * MB, figures
        assert held < 200 * MB, figures
        assert proc.stdin is not None
        await proc.stdin.aclose()  # --parent-stdin: the server exits
        with anyio.fail_after(30):
            await proc.wait()
