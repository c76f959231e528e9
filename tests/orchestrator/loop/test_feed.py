"""The batch feed over real HTTP on loopback: exactly-once delivery, refusals, backpressure."""

from __future__ import annotations

import json
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked
from structlog.testing import capture_logs

from orchestrator import train_worker
from orchestrator.config import load_config
from orchestrator.errors import ConfigError, TrainerError
from orchestrator.loop.feed import BatchFeed, serve_feed
from orchestrator.loop.feed_sink import FeedTrainer
from orchestrator.train_worker import FeedSource
from orchestrator.types import Batch, Group
from policies.board import Board
from policies.errors import FeedError, FeedUnavailable
from policies.wire.batches import BatchFile
from policies.wire.feed import FeedClient, feed_address
from staleness.config import StalenessConfig, TruncatedIS
from tests.support.trajectories import two_token_episode
from tests.support.waiting import until

pytestmark = pytest.mark.anyio

STALENESS = StalenessConfig(correction=TruncatedIS(cap=1.5))


def _batch(version: int = 0) -> Batch:
    group = Group(
        id="g0", task_id="t", episodes=[two_token_episode(0, 1.0), two_token_episode(1, 0.0)]
    )
    return Batch(trained_at_version=version, groups=[group], decisions=[])


def _wire(version: int) -> BatchFile:
    staleness = STALENESS.model_dump(mode="json")
    return BatchFile(version=version, group_size=1, samples=[], staleness=staleness)


def _board(tmp_path: Path) -> Board:
    board = Board(str(tmp_path / "board"), "run")
    board.publish(0, {"w": torch.zeros(2)}, view_name="float32")
    return board


def _publish(board: Board, version: int) -> None:
    board.publish(version, {"w": torch.full((2,), float(version))}, view_name="float32")


@asynccontextmanager
async def served(feed: BatchFeed, run_dir: Path, token: str = "t0k") -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        url = await tg.start(
            lambda task_status: serve_feed(
                feed,
                host="127.0.0.1",
                port=0,
                token=token,
                feed_file=run_dir / "feed.json",
                task_status=task_status,
            )
        )
        yield url
        tg.cancel_scope.cancel()


async def _next(client: FeedClient, wait_s: float = 0) -> BatchFile | None:
    return await anyio.to_thread.run_sync(client.next, wait_s)


async def _ack(client: FeedClient, version: int, metrics: dict[str, float] | None = None) -> None:
    await anyio.to_thread.run_sync(client.ack, version, metrics)


async def test_a_batch_is_delivered_until_acknowledged_and_never_after(tmp_path: Path) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest)
    async with served(feed, tmp_path) as url:
        client = FeedClient.discover(tmp_path)  # from feed.json
        assert client.url == url
        assert await _next(client) is None  # nothing offered yet: 204
        await feed.offer(_wire(0))
        first = await _next(client)
        again = await _next(FeedClient(url, "t0k"))  # a restarted trainer asks again
        assert first == again == _wire(0)
        assert first is not None
        assert StalenessConfig.model_validate(first.staleness) == STALENESS
        await anyio.to_thread.run_sync(_publish, board, 1)
        await _ack(client, 0, {"loss": 0.5})
        assert await feed.done(0) == {"loss": 0.5}
        assert feed.version == 1
        assert await _next(client) is None  # acknowledged: never delivered again
        await _ack(client, 0, {"loss": 9.0})  # a second ack is harmless and logs nothing
        assert feed.held == 0
        with pytest.raises(TimeoutError), anyio.fail_after(0.2):
            await feed.done(0)


async def test_a_long_poll_returns_the_batch_as_soon_as_it_is_offered(tmp_path: Path) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest)
    got: list[BatchFile | None] = []
    answered = anyio.Event()
    async with served(feed, tmp_path) as url, anyio.create_task_group() as tg:

        async def trainer() -> None:
            got.append(await _next(FeedClient(url, "t0k"), wait_s=60))
            answered.set()

        tg.start_soon(trainer)
        await until(  # the trainer's request waits on the feed (nothing else does here)
            lambda: feed._changed.statistics().tasks_waiting == 1, "the long poll waiting"
        )
        with anyio.fail_after(10):  # far below the 60 s it asked to wait
            await feed.offer(_wire(0))
            await answered.wait()
    assert got == [_wire(0)]


async def test_acks_that_do_not_fit_are_refused_with_409(tmp_path: Path) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest)
    async with served(feed, tmp_path) as url:
        client = FeedClient(url, "t0k")
        await feed.offer(_wire(0))
        with pytest.raises(FeedError, match=r"HTTP 409: batch 0 .* has not been delivered"):
            await _ack(client, 0)
        await _next(client)
        with pytest.raises(FeedError, match=r"HTTP 409: batch 3 is not out .* version 0"):
            await _ack(client, 3)
        with pytest.raises(FeedError, match=r"HTTP 409: version 1 is not on the board"):
            await _ack(client, 0)  # the pointer is the announcement: publish first
        assert (feed.held, feed.version) == (1, 0)  # nothing changed


async def test_bad_requests_are_400_naming_the_field(tmp_path: Path) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest)
    auth = {"Authorization": "Bearer t0k"}
    async with served(feed, tmp_path) as url, aiohttp.ClientSession(headers=auth) as http:
        cases = [
            ("GET", "/v1/batches/next?wait_s=-1", None, "wait_s"),
            ("GET", "/v1/batches/next?wait_s=soon", None, "wait_s"),
            ("POST", "/v1/batches/x/ack", None, "version"),
            ("POST", "/v1/batches/0/ack", {"metrics": {"loss": "low"}}, "metrics.loss"),
            ("POST", "/v1/batches/0/ack", {"metrics": [1.0]}, "metrics"),
            ("POST", "/v1/batches/0/ack", {"loss": 1.0}, "metrics"),
        ]
        for method, path, body, param in cases:
            async with http.request(method, url + path, json=body) as r:
                payload = await r.json()
                assert (r.status, payload["error"]["param"]) == (400, param), (path, payload)
                assert param in payload["error"]["message"]
    with pytest.raises(FeedError, match="loss: not finite"):
        FeedClient(url, "t0k").ack(0, {"loss": float("nan")})


async def test_a_wrong_token_is_401_and_a_missing_feed_names_its_url(tmp_path: Path) -> None:
    feed = BatchFeed(version=0, board_latest=_board(tmp_path).latest)
    async with served(feed, tmp_path) as url:
        with pytest.raises(FeedError, match=rf"GET {url}/v1/batches/next.*HTTP 401.*feed\.json"):
            await _next(FeedClient(url, "wrong"))
        mode = stat.S_IMODE((tmp_path / "feed.json").stat().st_mode)
        assert mode == 0o600
    with pytest.raises(FeedUnavailable, match=f"cannot reach the batch feed at {url}"):
        await _next(FeedClient(url, "t0k"))
    with pytest.raises(FeedUnavailable, match="not written yet"):
        feed_address(tmp_path / "elsewhere")


def test_the_environment_names_the_feed_before_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "feed.json").write_text(json.dumps({"url": "http://a:1", "token": "file"}))
    assert feed_address(tmp_path).token == "file"
    monkeypatch.setenv("SPRAWL_FEED_URL", "http://b:2/")
    monkeypatch.setenv("SPRAWL_FEED_TOKEN", "env")
    address = feed_address(tmp_path)
    assert (address.url, address.token) == ("http://b:2", "env")


async def test_a_trainer_that_published_but_died_before_acking_is_acknowledged(
    tmp_path: Path,
) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest)
    async with served(feed, tmp_path) as url:
        await feed.offer(_wire(0))
        assert await _next(FeedClient(url, "t0k")) is not None
        await anyio.to_thread.run_sync(_publish, board, 1)  # ... and the trainer dies here
        restarted = FeedClient(url, "t0k")
        assert await _next(restarted) is None  # batch 0 is not delivered again
        assert await feed.done(0) == {}
        assert feed.version == 1
        await _ack(restarted, 0)  # a late ack of it is a harmless duplicate


async def test_a_lost_ack_counts_once_the_board_has_shown_the_next_version_for_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step's ack lost (the reply, or the request): no later request settles it, so the
    run counts the board's version after the grace; a trainer whose last ack finds no feed stops
    after ``LAST_ACK_S`` with a warning instead of waiting ``timeouts.trainer_step_s``."""
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest, ack_grace_s=0.3)
    async with served(feed, tmp_path) as url:
        client = FeedClient(url, "t0k")
        await feed.offer(_wire(0))
        assert await _next(client) is not None
        await anyio.to_thread.run_sync(_publish, board, 1)  # ... and the ack never arrives
        with capture_logs() as logs, anyio.fail_after(30):
            assert await feed.done(0) == {}
        assert feed.version == 1
        assert [e["version"] for e in logs if e["event"] == "feed_acked_by_board"] == [0]
        await _ack(client, 0, {"loss": 0.5})  # a late ack of it is a harmless duplicate
    monkeypatch.setattr(train_worker, "LAST_ACK_S", 0.1)
    gone = FeedSource(tmp_path / "ended", poll_s=0.01, give_up_s=3600)
    with capture_logs() as logs:
        await anyio.to_thread.run_sync(lambda: gone.done(0, {"loss": 0.5}, last=True))
    (warning,) = [e for e in logs if e["event"] == "last_ack_undelivered"]
    assert warning["metrics"] == {"loss": 0.5}
    assert "gave up after 0.1s" in warning["error"]
    gone.give_up_s = 0.1
    with pytest.raises(TrainerError, match=r"feed\.json: not written yet"):
        await anyio.to_thread.run_sync(lambda: gone.done(0, {}, last=False))


async def test_a_restarted_feed_takes_the_ack_of_a_batch_an_earlier_feed_delivered(
    tmp_path: Path,
) -> None:
    """After an orchestrator restart the trainer acknowledges the batch the killed feed gave it:
    before the restarted run offered it again (the ack waits for that offer, metrics kept) or
    after (it was never delivered by this feed). The board showing v + 1 is what counts."""
    board = _board(tmp_path)
    await anyio.to_thread.run_sync(_publish, board, 1)  # the trainer finished batch 0
    feed = BatchFeed(version=0, board_latest=board.latest, capacity=2)
    async with served(feed, tmp_path) as url:
        client = FeedClient(url, "t0k")
        await _ack(client, 0, {"loss": 0.5})  # nothing offered yet
        assert (feed.version, feed.held) == (0, 0)
        await feed.offer(_wire(0))  # the restart re-forms batch 0 ...
        assert await feed.done(0) == {"loss": 0.5}  # ... and it is the acknowledged one
        assert feed.version == 1
        await feed.offer(_wire(1))  # offered, not delivered; the trainer publishes, then acks
        await anyio.to_thread.run_sync(_publish, board, 2)
        await _ack(client, 1, {"loss": 0.25})
        assert await feed.done(1) == {"loss": 0.25}
        assert (feed.version, feed.held) == (2, 0)
        assert await _next(client) is None  # neither is ever delivered again
        with pytest.raises(ValueError, match="offered out of order"):
            await feed.offer(_wire(1))
        with pytest.raises(FeedError, match=r"HTTP 409: batch 2 .* not been delivered"):
            await _ack(client, 2)  # the board does not show version 3: refused, as before


async def test_the_feed_holds_at_most_its_capacity(tmp_path: Path) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest, capacity=1)
    offered: list[int] = []
    second = anyio.Event()

    async def offer(version: int) -> None:
        await feed.offer(_wire(version))
        offered.append(version)
        if version == 1:
            second.set()

    async with served(feed, tmp_path) as url, anyio.create_task_group() as tg:
        client = FeedClient(url, "t0k")
        await offer(0)
        tg.start_soon(offer, 1)
        await wait_all_tasks_blocked()
        assert (offered, feed.held) == ([0], 1)  # the second batch waits for room
        await _next(client)
        await anyio.to_thread.run_sync(_publish, board, 1)
        await _ack(client, 0)
        with anyio.fail_after(5):
            await second.wait()
        assert (offered, feed.held) == ([0, 1], 1)
        assert await _next(client) == _wire(1)


async def test_the_feed_sink_returns_once_the_trainer_acknowledged(tmp_path: Path) -> None:
    board = _board(tmp_path)
    feed = BatchFeed(version=0, board_latest=board.latest)
    sink = FeedTrainer(feed, group_size=2, staleness=STALENESS, step_timeout_s=30)
    seen: list[BatchFile] = []
    async with served(feed, tmp_path) as url:

        def trainer() -> None:  # a trainer in "another process"
            client = FeedClient(url, "t0k")
            while (batch := client.next(wait_s=5)) is None:
                pass
            seen.append(batch)
            _publish(board, 1)
            client.ack(batch.version, {"loss": 0.25})

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, trainer)
            metrics = await sink.train(_batch())
    assert sink.version == 1
    assert metrics == {"loss": 0.25, "reward_mean": 0.5}
    (batch,) = seen
    assert (batch.version, batch.group_size, len(batch.samples)) == (0, 2, 2)
    assert batch.samples[0].policy_versions == [(3, 5, 0, 0)]
    assert StalenessConfig.model_validate(batch.staleness) == STALENESS


async def test_the_feed_sink_timeout_names_the_key(tmp_path: Path) -> None:
    feed = BatchFeed(version=0, board_latest=_board(tmp_path).latest)
    sink = FeedTrainer(feed, group_size=2, staleness=STALENESS, step_timeout_s=0.2)
    with pytest.raises(TrainerError, match=r"acknowledge batch 0 .*timeouts\.trainer_step_s"):
        await sink.train(_batch())
    assert feed.held == 1  # the batch is still there for the trainer, not lost


def test_feed_mode_needs_a_shared_board_resumes_and_bounds_its_batches() -> None:
    with pytest.raises(ConfigError, match=r"board\.url must be set when trainer\.mode is 'feed'"):
        load_config(Path("configs/demo.toml"), {"trainer.mode": "feed"})
    feed = {"trainer.mode": "feed", "board.url": "/tmp/b"}
    resumed = load_config(Path("configs/demo.toml"), {**feed, "run.resume": True})
    assert resumed.run.resume
    assert resumed.trainer.feed.max_batches == 1  # one at a time unless asked
    with pytest.raises(ConfigError, match=r"trainer\.feed\.max_batches"):
        load_config(Path("configs/demo.toml"), {**feed, "trainer.feed.max_batches": 0})
    with pytest.raises(
        ConfigError,
        match=r"max_batches = 3 can never fill: .*scheduler\.max_lag = 1.* set it to 2 or less",
    ):
        load_config(
            Path("configs/demo.toml"),
            {**feed, "scheduler.max_lag": 1, "trainer.feed.max_batches": 3},
        )
    cfg = load_config(
        Path("configs/demo.toml"),
        {**feed, "trainer.feed.port": 8765, "scheduler.max_lag": 1, "trainer.feed.max_batches": 2},
    )
    assert (cfg.trainer.feed.port, cfg.trainer.feed.max_batches) == (8765, 2)


async def test_orchestrate_train_gives_up_on_an_absent_feed_and_refuses_a_foreign_batch(
    tmp_path: Path,
) -> None:
    absent = FeedSource(tmp_path / "nowhere", poll_s=0.01, give_up_s=0.1)
    with pytest.raises(TrainerError, match=r"feed\.json: not written yet.*trainer_step_s"):
        await anyio.to_thread.run_sync(absent.batch, 0)
    board = _board(tmp_path)
    await anyio.to_thread.run_sync(_publish, board, 1)
    feed = BatchFeed(version=1, board_latest=board.latest)
    async with served(feed, tmp_path):
        await feed.offer(_wire(1))
        worker = FeedSource(tmp_path, poll_s=0.01, give_up_s=5)
        with pytest.raises(TrainerError, match="sent batch 1 but the trainer is at version 0"):
            await anyio.to_thread.run_sync(worker.batch, 0)
