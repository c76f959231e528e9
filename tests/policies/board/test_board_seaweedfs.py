"""The board on a real object store: SeaweedFS's S3 API on loopback (tests/support/seaweedfs.py),
killed in the middle of a publish and restarted on the same data, paused while a replica polls.

What holds (docs/reliability.md, "On a real object store"): versions published through the S3
API (deltas in chunks, anchors, catch-up patches) are followed and loaded bit-exactly; a server
killed mid-publish leaves no version half-visible, the publish fails with a ``BoardError``
naming the board, publishing again after the restart succeeds and a replica resumes from the
version it holds by patches; a paused server fails a replica's poll and a publish within the
store's bound (``policies.board.store``) and the replica catches up once it answers again;
credentials appear in no log line, error, metric, command output or object a run writes.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from structlog.testing import capture_logs

from policies.board import WEIGHTS, Board, BoardReader, stream_publish
from policies.board import store as board_store
from policies.board.types import chunk_file
from policies.errors import BoardError
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.engine import Engine
from policies.serve.sidecar import Sidecar
from tests.support.boards import adam_like_step, publish_scaled
from tests.support.s3 import KEY, SECRET
from tests.support.seaweedfs import BUCKET, Weed, seaweedfs

State = dict[str, torch.Tensor]
NAMES = [f"layers.{i}.weight" for i in range(4)]
CALL_BOUND_S = 20.0
"""How long a poll may take on a paused server with a 1 s read timeout (three tries and
botocore's backoff: 4–5 s; before they were bounded, one read of the pointer took 308 s)."""


@pytest.fixture(scope="module")
def weed() -> Iterator[Weed]:
    with seaweedfs() as server:
        yield server


@pytest.fixture
def server(weed: Weed) -> Iterator[Weed]:
    """The module's server, running and answering (a failed test may have left it stopped)."""
    if weed.proc is None:
        weed.start()
    weed.resume()
    yield weed
    if weed.proc is not None:
        weed.resume()


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One tensor per chunk: a delta is several objects, written one after the other."""
    monkeypatch.setattr(stream_publish, "CHUNK_VIEW_BYTES", 1)


def _url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


def _view(seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    view = {n: torch.randn(64, 256, generator=gen).to(torch.bfloat16) for n in NAMES}
    view["norm.bias"] = torch.randn(256, generator=gen)
    return view


def _chain(n: int) -> list[State]:
    states = [_view(0)]
    for v in range(1, n):
        states.append(adam_like_step(states[-1], v, density=0.02, float_noise=1e-3))
    return states


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _objects_whole(reader: BoardReader) -> None:
    """Every version the reader can list has every object its manifest names, at its size."""
    for v in reader.versions():
        m = reader.manifest(v)
        vdir = f"{reader.root}/versions/{v:08d}"
        files = {WEIGHTS: m.bytes} if m.kind == "anchor" else {}
        for p in m.patches:
            if p.chunks:
                files.update({chunk_file(p.base, i): c.bytes for i, c in enumerate(p.chunks)})
            else:
                files[p.file] = p.bytes
        for rel, size in files.items():
            assert reader.fs.size(f"{vdir}/{rel}") == size, f"version {v}: {rel}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@contextmanager
def resumed_after(weed: Weed, seconds: float) -> Iterator[None]:
    """Resume a paused server after ``seconds`` whatever happens: a call that would wait for it
    longer returns then, and the test fails on its clock instead of hanging."""
    timer = threading.Timer(seconds, weed.resume)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _timed(fn: Callable[[], object]) -> tuple[Exception | None, float]:
    """What ``fn`` raised (None if nothing) and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# -- 1. publish and follow through the S3 API ------------------------------------------------------


def test_a_run_published_through_s3_is_followed_bit_exactly(server: Weed) -> None:
    url = _url()
    pub = Board(url, "run", storage_options=server.options(), anchor_every=3)
    reader = BoardReader(url, "run", storage_options=server.options())
    states = _chain(7)
    held: State = {}
    for v, state in enumerate(states):
        pub.publish(v, state, view_name="bfloat16")
        assert reader.latest() == v
        if v == 0:
            held = reader.load(0)[1]
        else:
            assert reader.catch_up(v - 1, v).anchor is None  # a patch, not a reload
            reader.advance(held, v - 1, v)
        assert _same(held, state), f"version {v}"
    kinds = [reader.manifest(v).kind for v in reader.versions()]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta", "anchor"]
    assert reader.manifest(2).patches[0].chunks  # the delta went up chunk by chunk
    _objects_whole(reader)
    late = BoardReader(url, "run", storage_options=server.options())
    assert _same(late.load(5)[1], states[5])  # an anchor and its deltas
    lagging = late.load(1)[1]
    plan = late.catch_up(1, 6)
    assert plan.anchor is None
    assert len(plan.steps) <= 3  # squashed catch-up patches
    late.advance(lagging, 1, 6)
    assert _same(lagging, states[6])


# -- 2. the server killed in the middle of a publish, restarted on the same data -----------------

KILL_POINTS = {
    # the publisher's write the server dies just before, and whether the version is published by
    # then (the pointer moved); a delta has one chunk per tensor here, 5 in all
    "after-two-chunks": ("*/versions/00000002/from-00000001/00002.patch", False),
    "before-the-pointer": ("*/POINTER", False),
    "before-the-catch-up-patches": ("*/versions/00000002/from-00000000/00000.patch", True),
}


class KillBefore:
    """Kills the server just before ``board``'s publisher writes the first object whose path
    matches ``pattern``: that write, and the publish, meet a dead server."""

    def __init__(self, board: Board, weed: Weed, pattern: str) -> None:
        self.weed, self.pattern, self.fired = weed, pattern, False
        self._write = board._write
        board._write = self.write  # type: ignore[method-assign]

    def write(self, path: str, data: bytes) -> None:
        if not self.fired and fnmatch.fnmatch(path, self.pattern):
            self.fired = True
            self.weed.kill()
        self._write(path, data)


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_server_killed_mid_publish_leaves_no_version_half_visible(
    server: Weed, point: str
) -> None:
    pattern, published = KILL_POINTS[point]
    url, states = _url(), _chain(4)
    # two tries a call, not three: a dead server's refusals are not waited out twice (the
    # paused-store test is the one about retries)
    options = server.options(config_kwargs={"retries": {"total_max_attempts": 2}})
    pub = Board(url, "run", storage_options=options)
    reader = BoardReader(url, "run", storage_options=options)
    for v in (0, 1):
        pub.publish(v, states[v], view_name="bfloat16")
    held = reader.load(1)[1]
    kill = KillBefore(pub, server, pattern)
    with pytest.raises(BoardError) as failed:
        pub.publish(2, states[2], view_name="bfloat16")
    assert kill.fired
    assert str(failed.value).startswith(f"board {url}: writing ")
    error, _ = _timed(reader.latest)  # a dead server: an error, not a wait
    assert isinstance(error, BoardError)
    server.start()  # the same ports and data directory
    latest = reader.latest()
    assert latest == (2 if published else 1)
    assert reader.versions() == list(range(latest + 1))
    _objects_whole(reader)  # the pointer's version, and every one below it, whole
    if not published:  # what was written of version 2 is there, and not visible
        assert reader.fs.exists(f"{reader.root}/versions/00000002/from-00000001/00000.patch")
        with pytest.raises(BoardError, match="not published"):
            reader.load(2)
    # the replica resumes from the version it holds, by patches
    assert reader.catch_up(1, latest).anchor is None
    reader.advance(held, 1, latest)
    assert _same(held, states[latest])
    if published:  # the version is out: only a later one can follow
        with pytest.raises(BoardError, match="pointer only moves forward"):
            pub.publish(2, states[2], view_name="bfloat16")
    else:
        pub.publish(2, states[2], view_name="bfloat16")
    pub.publish(3, states[3], view_name="bfloat16")
    # a publisher whose publish raised after its pointer moved no longer trusts what it holds
    assert reader.manifest(3).kind == ("anchor" if published else "delta")
    _objects_whole(reader)
    reader.advance(held, latest, 3)
    assert _same(held, states[3])
    fresh = BoardReader(url, "run", storage_options=options)
    assert all(_same(fresh.load(v)[1], states[v]) for v in range(4))


# -- 3. a paused server while a replica polls ------------------------------------------------------


@pytest.mark.anyio
async def test_a_paused_store_fails_a_replica_s_polls_within_a_bound_and_it_catches_up(
    server: Weed, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what every s3:// board gets (policies.board.store), with a read timeout of 1 s, not 15
    monkeypatch.setattr(board_store, "S3_READ_TIMEOUT_S", 1.0)
    url = _url()
    pub = Board(url, "run", storage_options=server.options())
    pub.create(tiny_model_dir)
    publish_scaled(pub, 0, tiny_model_dir)
    views = [pub.load(0)[1]]
    for v in (1, 2):
        views.append(adam_like_step(views[-1], seed=v, density=0.05))
    engine = Engine(tiny_model_dir, dtype=torch.bfloat16)
    board = Board(url, "run", storage_options=server.options())
    sidecar = Sidecar(
        ReferenceBackend(engine), board, poll_interval_s=3600, registry=CollectorRegistry()
    )
    try:
        await sidecar.reconcile()
        pub.publish(1, views[1], view_name="bfloat16")
        await sidecar.reconcile()
        assert sidecar.applied_version == 1
        server.pause()
        with capture_logs() as logs, resumed_after(server, CALL_BOUND_S + 5):
            start = time.monotonic()
            await sidecar.reconcile()  # the poll fails; it does not wait for the server
            took = time.monotonic() - start
        assert 3 * 1.0 <= took < CALL_BOUND_S  # three tries, each given up after 1 s
        with resumed_after(server, CALL_BOUND_S + 5):
            error, took = _timed(lambda: pub.publish(2, views[2], view_name="bfloat16"))
        assert 3 * 1.0 <= took < CALL_BOUND_S
        assert isinstance(error, BoardError)
        assert str(error).startswith(f"board {url}: ")
        assert "timeout" in str(error).lower()
        unreadable = [e for e in logs if e["event"] == "board_unreadable"]
        assert len(unreadable) == 1
        assert "ReadTimeoutError" in unreadable[0]["error"]
        assert sidecar.applied_version == 1  # the old version keeps serving
        assert sidecar.state == "serving"
        server.resume()
        pub.publish(2, views[2], view_name="bfloat16")
        await sidecar.reconcile()
        assert sidecar.applied_version == 2
        live = engine.live_tensors()
        assert all(torch.equal(_bits(live[k]), _bits(t)) for k, t in views[2].items() if k in live)
    finally:
        engine.close()


# -- 4. credentials --------------------------------------------------------------------------------

WRONG_SECRET = "sprawl-wrong-secret-do-not-log-5678"


def _leaks(text: str | bytes) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s for s in (KEY, SECRET, WRONG_SECRET) if s.encode() in data]


def _aws_env(monkeypatch: pytest.MonkeyPatch, weed: Weed) -> None:
    """Credentials and endpoint in the environment, as ``orchestrate`` takes them."""
    for name, value in [
        ("AWS_ACCESS_KEY_ID", KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
        ("AWS_ENDPOINT_URL", weed.endpoint),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ]:
        monkeypatch.setenv(name, value)


@pytest.mark.anyio
async def test_credentials_appear_in_no_log_error_or_metric(
    server: Weed,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The publisher's credentials come as storage options, a replica's from the environment;
    a replica with a wrong secret, a store that is not there and a URL holding credentials
    give errors."""
    _aws_env(monkeypatch, server)
    url = _url()
    errors: list[BoardError] = []
    engine = Engine(tiny_model_dir, dtype=torch.bfloat16)
    try:
        with capture_logs() as logs, caplog.at_level(logging.WARNING):
            pub = Board(url, "run", storage_options=server.options())
            pub.create(tiny_model_dir)
            publish_scaled(pub, 0, tiny_model_dir)
            registry, other_registry = CollectorRegistry(), CollectorRegistry()
            replica = Board(url, "run")
            sidecar = Sidecar(
                ReferenceBackend(engine), replica, poll_interval_s=3600, registry=registry
            )
            await sidecar.reconcile()
            pub.publish(
                1, adam_like_step(pub.load(0)[1], seed=1, density=0.05), view_name="bfloat16"
            )
            await sidecar.reconcile()
            assert sidecar.applied_version == 1
            refused = Board(url, "run", storage_options=server.options(secret=WRONG_SECRET))
            failing = Sidecar(
                ReferenceBackend(engine), refused, poll_interval_s=3600, registry=other_registry
            )
            await failing.reconcile()  # logs board_unreadable
            gone = server.options(client_kwargs={"endpoint_url": "http://127.0.0.1:1"})
            in_url = f"s3://{KEY}:{SECRET}@{BUCKET}/p"  # s3fs takes no credentials from a URL
            calls = [Board(url, "run", storage_options=gone).latest]
            for board in (refused, Board(in_url, "run", storage_options=server.options())):
                calls += [board.latest, partial(board.store.write, f"{board.root}/x", b"x")]
            for call in calls:
                with pytest.raises(BoardError, match=r"^board s3://") as info:
                    call()
                errors.append(info.value)
        assert any(e["event"] == "board_unreadable" for e in logs)
        metrics = generate_latest(registry) + generate_latest(other_registry)
    finally:
        engine.close()
    assert not _leaks(repr(logs)), "structlog events"
    assert not _leaks(caplog.text), "stdlib log records"
    for e in errors:
        assert not _leaks(str(e) + repr(e)), str(e)
        assert e.__cause__ is None
        assert e.__suppress_context__
    assert not _leaks(metrics), "the sidecar's metrics"


def test_credentials_appear_in_nothing_the_command_line_prints_or_a_run_writes(
    server: Weed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cli_logging: None,
) -> None:
    from orchestrator.cli import main

    _aws_env(monkeypatch, server)
    url, states = _url(), _chain(2)
    pub = Board(url, "run", storage_options=server.options())
    for v, state in enumerate(states):
        pub.publish(v, state, view_name="bfloat16")
    capsys.readouterr()
    board_args = ["--board", url, "--run", "run"]
    assert main(["versions", *board_args, "--json"]) == 0
    assert [row["version"] for row in json.loads(capsys.readouterr().out)] == [0, 1]
    out = tmp_path / "ckpt"
    assert main(["materialize", *board_args, "--version", "1", "--out", str(out)]) == 0
    cli = capsys.readouterr()
    refused = subprocess.run(  # a process of its own: it reads the environment afresh
        [sys.executable, "-m", "orchestrator.cli", "versions", *board_args],
        env={**os.environ, "AWS_SECRET_ACCESS_KEY": WRONG_SECRET},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"orchestrate: error: board {url}: "), refused.stderr
    assert not _leaks(cli.out + cli.err + refused.stdout + refused.stderr)
    assert sorted(f.name for f in out.iterdir()) == [WEIGHTS]
    assert not _leaks((out / WEIGHTS).read_bytes())
    written = pub.fs.find(pub.root)  # pointer, stream, manifests, anchor, chunks
    assert f"{pub.root}/versions/00000001/manifest.json" in written
    for path in written:
        assert not _leaks(pub.fs.cat_file(path)), path
