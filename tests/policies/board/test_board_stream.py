"""Streamed publish: readers stage chunks while the publisher encodes the rest, and never serve a
version before it is published (policies/board/stream.py)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from policies.board import Board, stream_publish
from policies.board import stream as board_stream
from policies.board.types import (
    FORMAT,
    Manifest,
    Stream,
    chunk_file,
)
from policies.errors import BoardError, VersionCorrupt
from tests.support.stream import AskedTogether, Gate, Staging

MakeBoard = Callable[..., Board]
State = dict[str, torch.Tensor]
NAMES = [f"layers.{i}.weight" for i in range(4)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One tensor per chunk, and a stalled stream given up after 3 s."""
    monkeypatch.setattr(stream_publish, "CHUNK_VIEW_BYTES", 1)
    monkeypatch.setattr(board_stream, "STALL_S", 3.0)


def _view(seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(64, 256, generator=gen).to(torch.bfloat16) for n in NAMES}


def _step(view: State, seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in view.items():
        bits = t.clone().view(torch.int16).reshape(-1)
        bits[torch.randint(0, bits.numel(), (200,), generator=gen)] ^= 1
        out[n] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def _streaming(reader: Board, version: int) -> bool:
    stream = reader.stream()
    return stream is not None and stream.version == version


def test_a_reader_stages_the_first_tensor_before_the_publisher_wrote_the_last(
    make_board: MakeBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the gated publisher waits on the checks below, which take 1–1.5 s on an S3 board and
    # more on a slow host: not a stall (the short STALL_S is for the dying publisher's tests)
    monkeypatch.setattr(board_stream, "STALL_S", 30.0)
    v0 = _view(0)
    v1 = _step(v0, 1)
    pub = make_board()
    gate = Gate(pub, at=len(NAMES) - 1)
    pub.publish(0, v0, view_name="bfloat16")
    reader = make_board()
    held = reader.load(0)[1]
    staging = Staging(monkeypatch)
    done: list[object] = []

    def follow() -> None:
        try:
            done.append(reader.advance(held, 0, 1))
        except BaseException as exc:  # reported by the assertion below
            done.append(exc)

    publish = threading.Thread(target=pub.publish, args=(1, v1), kwargs={"view_name": "bfloat16"})
    publish.start()
    assert gate.reached.wait(30)  # STREAM and every chunk but the last are written
    assert _streaming(reader, 1)
    t = threading.Thread(target=follow)
    t.start()
    assert staging.wait_for(NAMES[0]), done  # staged while the last chunk is not written
    assert _same({NAMES[0]: held[NAMES[0]]}, {NAMES[0]: v1[NAMES[0]]})
    # half published: nothing serves it, and the reader is still waiting
    assert make_board().latest() == 0
    assert make_board().versions() == [0]
    with pytest.raises(BoardError, match="version 1 is not published"):
        make_board().load(1)
    assert not done
    gate.go.set()
    publish.join(30)
    t.join(30)
    assert isinstance(done[0], Manifest), done
    assert done[0].version == 1
    assert _same(held, v1)
    assert _same(make_board().load(1)[1], v1)  # and the published version reads the usual way


def test_a_publisher_that_dies_mid_stream_leaves_nothing_servable(make_board: MakeBoard) -> None:
    v0 = _view(0)
    v1 = _step(v0, 1)
    pub = make_board()
    gate = Gate(pub, at=2, crash=True)
    gate.go.set()
    pub.publish(0, v0, view_name="bfloat16")
    reader = make_board()
    held = reader.load(0)[1]
    with pytest.raises(BoardError, match="publisher died"):
        pub.publish(1, v1, view_name="bfloat16")
    assert _streaming(reader, 1)
    with pytest.raises(BoardError, match="stalled: no chunk 2"):
        reader.advance(held, 0, 1)  # chunks 0 and 1 applied, then nothing more
    assert reader.latest() == 0
    assert reader.versions() == [0]
    # a restarted trainer holds no views: it publishes the version again, as an anchor
    restarted = make_board()
    restarted.publish(1, v1, view_name="bfloat16")
    assert restarted.manifest(1).kind == "anchor"
    view: State = {}
    reader.advance(view, None, 1)
    assert _same(view, v1)


def test_a_stream_replaced_by_another_attempt_is_never_served(
    make_board: MakeBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0 = _view(0)
    first, second = _step(v0, 1), _step(v0, 2)
    pub = make_board()
    gate = Gate(pub, at=2, crash=True)
    pub.publish(0, v0, view_name="bfloat16")
    reader = make_board()
    held = reader.load(0)[1]
    staging = Staging(monkeypatch)
    errors: list[BaseException] = []

    def attempt() -> None:
        with pytest.raises(BoardError, match="publisher died"):
            pub.publish(1, first, view_name="bfloat16")

    def follow() -> None:
        try:
            reader.advance(held, 0, 1)
        except BoardError as exc:
            errors.append(exc)

    dying = threading.Thread(target=attempt)
    dying.start()
    assert gate.reached.wait(30)
    following = threading.Thread(target=follow)
    following.start()
    assert staging.wait_for(NAMES[1]), errors  # the first attempt's chunks 0 and 1
    assert _same({NAMES[1]: held[NAMES[1]]}, {NAMES[1]: first[NAMES[1]]})
    gate.go.set()
    dying.join(30)
    gate.at = -1  # the publisher tries again (it still holds version 0), with other weights
    pub.publish(1, second, view_name="bfloat16")
    following.join(30)
    assert errors, "the first attempt's chunks were served"
    assert "version 1" in str(errors[0])
    assert not _same(held, second)
    view = reader.load(0)[1]
    reader.advance(view, 0, 1)
    assert _same(view, second)


def test_the_stream_is_announced_and_recorded_chunk_by_chunk(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    v0 = _view(0)
    board = make_board()
    board.publish(0, v0, view_name="bfloat16")
    m = board.publish(1, _step(v0, 1), view_name="bfloat16")
    (ref,) = m.patches
    assert m.format == FORMAT
    assert len(ref.chunks) == len(NAMES)
    assert ref.bytes == sum(c.bytes for c in ref.chunks) == m.bytes
    stream = make_board().stream()
    assert stream is not None
    assert stream.version == 1
    assert stream.chunks == [[n] for n in NAMES]
    assert stream.bases == {0: board.manifest(0).digest}
    for i, c in enumerate(ref.chunks):
        raw = board.store.read(
            f"{board.root}/versions/00000001/from-00000000/{i:05d}.patch", c.bytes
        )
        assert len(raw) == c.bytes <= stream.limits[i]


def test_a_version_is_served_before_the_patches_for_replicas_further_behind_are_written(
    make_board: MakeBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the previous version's patch is streamed and committed (manifest, pointer) before
    the version is servable; the patches from older versions follow, and the manifest is written
    again with them (fails when every patch is encoded before the commit)."""
    board = make_board()
    views = [_view(0)]
    for v in range(1, 4):
        views.append(_step(views[-1], v))
    for v in range(3):
        board.publish(v, views[v], view_name="bfloat16")
    written: list[str] = []
    seen: dict[str, Manifest] = {}
    write = board._write

    def record(path: str, data: bytes) -> None:
        write(path, data)
        rel = path.removeprefix(f"{board.root}/")
        written.append(rel)
        if rel == "POINTER":  # what a reader reads the moment the version is committed
            seen["at commit"] = make_board().manifest(3)

    monkeypatch.setattr(board, "_write", record)
    final = board.publish(3, views[3], view_name="bfloat16")
    assert sorted(p.base for p in final.patches) == [0, 2]
    pointer = written.index("POINTER")
    assert all("from-00000000" not in w for w in written[:pointer]), written
    assert any("from-00000000" in w for w in written[pointer:]), written
    assert written[-1] == "versions/00000003/manifest.json"
    assert [p.base for p in seen["at commit"].patches] == [2]
    assert seen["at commit"].digest == final.digest
    stream = make_board().stream()
    assert stream is not None
    assert stream.bases == {2: board.manifest(2).digest}
    fresh: State = {}
    make_board().advance(fresh, None, 3)  # anchor 0, then the patch from it
    assert _same(fresh, views[3])
    behind = {k: t.clone() for k, t in views[0].items()}
    make_board().advance(behind, 0, 3)
    assert _same(behind, views[3])


class _Chunks:
    """A stream source (:meth:`source`) over the chunks written so far (relative path → bytes;
    :meth:`write` adds some), for :func:`board_stream.follow`. It records every ask with the
    chunks written at that moment, and wakes whoever waits on the asks (:meth:`until`)."""

    def __init__(self, stream: Stream, chunks: dict[str, bytes], latest: int = 1) -> None:
        self.stream, self.chunks, self.latest = stream, dict(chunks), latest
        self.asks: list[tuple[str, frozenset[str]]] = []
        self._changed = threading.Condition()  # an RLock: ``until`` may call ``asked``

    def source(self) -> board_stream.StreamSource:
        return board_stream.StreamSource(
            chunk=self.chunk, stream=lambda: self.stream, latest=lambda: self.latest
        )

    def chunk(self, rel: str, limit: int) -> bytes | None:
        with self._changed:
            self.asks.append((rel, frozenset(self.chunks)))
            self._changed.notify_all()
            return self.chunks.get(rel)

    def write(self, chunks: dict[str, bytes], latest: int | None = None) -> None:
        with self._changed:
            self.chunks.update(chunks)
            self.latest = self.latest if latest is None else latest

    def asked(self, rel: str) -> list[frozenset[str]]:
        """For each ask for ``rel``, in order: the chunks written then."""
        with self._changed:
            return [written for r, written in self.asks if r == rel]

    def until(self, ready: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Whether ``ready()``, checked after every ask, held within ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(ready, timeout_s)


def _three_chunks() -> Stream:
    return Stream(version=1, id="s", bases={0: "d0"}, chunks=[["a"], ["b"], ["c"]], limits=[9] * 3)


def test_a_replica_fetches_the_next_chunk_while_it_applies_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over a slow link, fetching chunk i + 1 only after chunk i is applied and verified would
    leave the link idle for every apply."""
    stream = _three_chunks()
    chunks = _Chunks(stream, {chunk_file(0, i): bytes([i]) for i in range(3)})
    next_on_hand: list[bool] = []

    def apply(view: State, data: bytes, where: str, digest: str | None, **_: object) -> object:
        i = data[0]
        if i < 2:  # chunk i is applied until chunk i + 1 is fetched (waits for good otherwise)
            next_on_hand.append(chunks.until(lambda: bool(chunks.asked(chunk_file(0, i + 1)))))
        return board_stream.StagedChunk(board_stream.chunk_ref(data), {})

    monkeypatch.setattr(board_stream, "apply_frame", apply)
    staged = board_stream.follow({}, 0, stream, chunks.source(), where="test")
    assert len(staged) == 3
    assert next_on_hand == [True, True]  # each on hand before the one before it was applied


def test_a_replica_whose_apply_fails_stops_fetching_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fetcher waiting for a chunk that never lands must not hold the failure back for the
    stall timeout."""
    monkeypatch.setattr(board_stream, "STALL_S", 30.0)
    stream = _three_chunks()
    chunks = _Chunks(stream, {chunk_file(0, 0): b"\x00"}, latest=0)  # 1 and 2 never written

    def failing_apply(
        view: State, data: bytes, where: str, digest: str | None, **_: object
    ) -> object:
        # the fetcher is polling for chunk 1 (asked for again since it first was)
        assert chunks.until(lambda: len(chunks.asked(chunk_file(0, 1))) >= 2)
        raise VersionCorrupt(f"{where}: damaged")

    monkeypatch.setattr(board_stream, "apply_frame", failing_apply)
    start = time.monotonic()
    with pytest.raises(BoardError, match="damaged"):
        board_stream.follow({}, 0, stream, chunks.source(), where="test")
    assert time.monotonic() - start < 5


def _stub_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    def apply(view: State, data: bytes, where: str, digest: str | None, **_: object) -> object:
        return board_stream.StagedChunk(board_stream.chunk_ref(data), {})

    monkeypatch.setattr(board_stream, "apply_frame", apply)


def test_a_replica_asks_for_the_next_chunks_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A board a round trip away (an object store in another region) answers the requests in
    flight together once per round trip; asked for one by one, every chunk would cost one."""
    _stub_apply(monkeypatch)
    n = board_stream.FETCH_AHEAD + 2
    stream = Stream(
        version=1, id="s", bases={0: "d0"}, chunks=[[f"t{i}"] for i in range(n)], limits=[9] * n
    )
    source = _Chunks(stream, {chunk_file(0, i): bytes([i]) for i in range(n)}).source()
    together = threading.Barrier(board_stream.FETCH_AHEAD, timeout=10)

    def chunk(rel: str, limit: int) -> bytes | None:
        if rel in {chunk_file(0, i) for i in range(board_stream.FETCH_AHEAD)}:
            together.wait()  # broken (raises) unless all of the first ones are asked at once
        return source.chunk(rel, limit)

    staged = board_stream.follow(
        {}, 0, stream, dataclasses.replace(source, chunk=chunk), where="test"
    )
    assert [s.ref for s in staged] == [board_stream.chunk_ref(bytes([i])) for i in range(n)]


def test_a_chunk_not_written_yet_is_polled_only_after_the_one_before_it_landed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The publisher writes chunks in order: while chunk 1 is missing, polling chunks 2 and 3 too
    would only multiply the requests (an object store bills each). They are asked for again
    only when a chunk lands (here chunk 0)."""
    _stub_apply(monkeypatch)
    stream = Stream(
        version=1, id="s", bases={0: "d0"}, chunks=[["a"], ["b"], ["c"], ["d"]], limits=[9] * 4
    )
    chunks = _Chunks(stream, {chunk_file(0, 0): b"\x00"}, latest=0)
    one, two = chunk_file(0, 1), chunk_file(0, 2)

    def publisher() -> None:
        # chunk 1 once the reader has polled it a while; the rest once it polls chunk 2
        assert chunks.until(lambda: len(chunks.asked(one)) >= 20)
        chunks.write({one: b"\x01"})
        assert chunks.until(lambda: any(one in written for written in chunks.asked(two)))
        chunks.write({two: b"\x02", chunk_file(0, 3): b"\x03"}, latest=1)

    writer = threading.Thread(target=publisher)
    writer.start()
    staged = board_stream.follow({}, 0, stream, chunks.source(), where="test")
    writer.join()
    assert len(staged) == 4
    missing = [one in written for written in chunks.asked(one)].count(False)
    assert missing > 5  # polled while it was missing
    for i in (2, 3):  # at once, and once more when chunk 0 landed
        assert [one in written for written in chunks.asked(chunk_file(0, i))].count(False) <= 2


class _InFlight:
    """Counts the calls inside it at once; ``most`` is the most seen."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.now = self.most = 0
        self._alone = False

    def __enter__(self) -> None:
        with self._changed:
            self.now += 1
            self.most = max(self.most, self.now)
            self._changed.notify_all()

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self.now -= 1

    def wait_for_company(self, timeout_s: float = 10.0) -> None:
        """Until two calls were inside at once (from a call inside); after one wait in vain,
        no call waits again (``most`` then tells)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.most >= 2 or self._alone, timeout_s):
                self._alone = True


def test_fetching_keeps_the_bytes_in_flight_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each fetch counts the chunks asked for ahead of the one the consumer takes next (its own
    included): at most the budget's worth, however fast the fetches run."""
    monkeypatch.setattr(board_stream, "FETCH_BYTES", 25)
    for sizes, allowed in (([10] * 6, 2), ([100] * 3, 1)):
        taken, ahead = [0], [0]

        def fetch(i: int, taken: list[int] = taken, ahead: list[int] = ahead) -> bytes:
            ahead[0] = max(ahead[0], i + 1 - taken[0])
            return bytes([i])

        with board_stream.fetching(fetch, sizes) as got:
            for want, data in enumerate(got):
                assert data[0] == want
                taken[0] += 1
        assert taken[0] == len(sizes)
        assert ahead[0] <= allowed  # 10 + 10 fit in 25; a chunk past the budget goes alone


def test_a_published_version_is_caught_up_with_the_next_chunks_in_flight(
    tmp_path: Path,
) -> None:
    """Chunks of a version already published (a reader catching up) cross while the one
    before them is applied, asked for together."""
    v0 = _view(0)
    v1 = _step(v0, 1)
    publisher = Board(str(tmp_path / "board"), "run")
    publisher.publish(0, v0, view_name="bfloat16")
    publisher.publish(1, v1, view_name="bfloat16")
    flying = _InFlight()

    class Distant(Board):
        def _read(self, path: str, limit: int) -> bytes:
            if not path.endswith(".patch"):
                return super()._read(path, limit)
            with flying:  # a round trip: answered once another chunk is asked for too
                flying.wait_for_company()
                return super()._read(path, limit)

    held = {k: t.clone() for k, t in v0.items()}
    Distant(str(tmp_path / "board"), "run").advance(held, 0, 1)
    assert _same(held, v1)
    assert flying.most >= 2


def test_a_replica_asks_for_the_pointer_and_the_stream_together(tmp_path: Path) -> None:
    """Advancing to a version being streamed reads the pointer (is it published yet?) and the
    stream: asked one after the other, a board a round trip away costs two."""
    v0 = _view(0)
    v1 = _step(v0, 1)
    pub = Board(str(tmp_path / "board"), "run")
    gate = Gate(pub, at=len(NAMES) - 1)
    pub.publish(0, v0, view_name="bfloat16")
    distant = Board(str(tmp_path / "board"), "run")
    together = AskedTogether(distant)
    publish = threading.Thread(target=pub.publish, args=(1, v1), kwargs={"view_name": "bfloat16"})
    publish.start()
    assert gate.reached.wait(30)
    held = {k: t.clone() for k, t in v0.items()}
    done: list[object] = []

    def follow() -> None:
        try:
            done.append(distant.advance(held, 0, 1))
        except BaseException as exc:  # reported by the assertion below
            done.append(exc)

    t = threading.Thread(target=follow)
    t.start()
    assert together.both.wait(30)
    gate.go.set()  # the version is published only once the reader follows its stream
    publish.join(30)
    t.join(30)
    assert isinstance(done[0], Manifest), done
    assert done[0].version == 1
    assert _same(held, v1)


def test_advancing_to_a_published_version_asks_for_the_pointer_once_at_most(
    tmp_path: Path,
) -> None:
    """Each read of the pointer is a round trip to a distant board: advancing to a published
    version reads it once, and not at all once it was seen at or past that version (it never
    moves back), as after a sidecar's reconcile."""
    v0 = _view(0)
    v1 = _step(v0, 1)
    v2 = _step(v1, 2)
    pub = Board(str(tmp_path / "board"), "run")
    for v, s in enumerate((v0, v1, v2)):
        pub.publish(v, s, view_name="bfloat16")
    pointer_reads = [0]

    class Counting(Board):
        def _read(self, path: str, limit: int) -> bytes:
            pointer_reads[0] += path.endswith("/POINTER")
            return super()._read(path, limit)

    reader = Counting(str(tmp_path / "board"), "run")
    held = {k: t.clone() for k, t in v0.items()}
    reader.advance(held, 0, 1)
    assert pointer_reads[0] == 1
    assert reader.latest() == 2  # as a sidecar's reconcile reads it
    pointer_reads[0] = 0
    reader.advance(held, 1, 2)
    assert pointer_reads[0] == 0
    assert _same(held, v2)


def test_the_commit_is_watched_while_the_last_chunks_are_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the pointer and then the new manifest only after the last chunk is applied
    would add two round trips to a distant board after the link has done its part."""
    stream = _three_chunks()
    chunks = _Chunks(stream, {chunk_file(0, i): bytes([i]) for i in range(3)})
    read = threading.Event()
    read_first: list[bool] = []

    def apply(view: State, data: bytes, where: str, digest: str | None, **_: object) -> object:
        if data[0] == 0:  # the first chunk is applied until the commit is read (for good if
            read_first.append(read.wait(10))  # it is watched only after the last one)
        return board_stream.StagedChunk(board_stream.chunk_ref(data), {})

    monkeypatch.setattr(board_stream, "apply_frame", apply)
    commits: list[None] = []
    staged = board_stream.follow(
        {},
        0,
        stream,
        chunks.source(),
        where="test",
        on_commit=lambda: (commits.append(None), read.set()),
    )
    assert len(staged) == 3
    assert len(commits) == 1
    assert read_first == [True]  # all chunks were asked for at once: watched from the start


class _ReaderClock:
    """The stream reader's clock (``board_stream.time``), moved by the test alone; it records
    which threads read it since it last moved, so the test knows when a reader has looked at
    the new time (and, finding nothing new, checked its stall clock against it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.readers: list[str] = []
        self._read = threading.Condition()

    def monotonic(self) -> float:
        with self._read:
            self.readers.append(threading.current_thread().name)
            self._read.notify_all()
            return self.now

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)  # the reader's own poll interval (POLL_S), passed through

    def move(self, seconds: float, *, seen_by: tuple[str, ...]) -> None:
        """Move on ``seconds``, then wait until every thread named ``seen_by…`` has read the
        new time twice (one whole poll of its loop)."""
        with self._read:
            self.now += seconds
            self.readers = []
            assert self._read.wait_for(
                lambda: all(sum(r.startswith(who) for r in self.readers) >= 2 for who in seen_by),
                10,
            ), f"{seen_by} never looked at the clock at {self.now:g} s"


def test_a_slow_publisher_is_not_taken_for_a_stalled_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk, and the commit, come within the stall timeout of the one before, though the
    whole stream takes longer: the reader keeps following (its stall clocks count from the
    last progress, not from when it first asked). The reader's clock is the test's: each step
    is 0.3 s of it (STALL_S is 0.5), all of them 1.5 s, whatever the machine's pace."""
    _stub_apply(monkeypatch)
    monkeypatch.setattr(board_stream, "STALL_S", 0.5)
    clock = _ReaderClock()
    monkeypatch.setattr(board_stream, "time", clock)
    stream = Stream(
        version=1, id="s", bases={0: "d0"}, chunks=[["a"], ["b"], ["c"], ["d"]], limits=[9] * 4
    )
    chunks = _Chunks(stream, {}, latest=0)

    def publisher() -> None:
        try:
            for i in range(4):  # 0.3 s without chunk i, seen by its fetch and the commit watch
                clock.move(0.3, seen_by=("board-fetch", "board-commit"))
                rel = chunk_file(0, i)
                chunks.write({rel: bytes([i])})
                assert chunks.until(lambda rel=rel: any(rel in w for w in chunks.asked(rel)))
            clock.move(0.3, seen_by=("board-commit",))  # 0.3 s without the commit
            chunks.write({}, latest=1)
        except AssertionError:  # a reader thread is gone: let the others stall out, not hang
            clock.now = math.inf
            raise

    writer = threading.Thread(target=publisher)
    writer.start()
    staged = board_stream.follow({}, 0, stream, chunks.source(), where="t")
    writer.join()
    assert len(staged) == 4
