"""The version board, on a local directory and on an S3-compatible server (moto) on loopback."""

from __future__ import annotations

import errno
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from orchestrator.bench.optimizer_steps import train_states
from policies.board import WEIGHTS, Board, anchor_payload, redact
from policies.errors import BoardError, PatchBaseMismatch, PointerMalformed, VersionCorrupt
from tests.support.boards import adam_like_step
from tests.support.s3 import KEY, SECRET, s3_options

State = dict[str, torch.Tensor]
MakeBoard = Callable[..., Board]


def _model(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: stored once, stays tied
        "layers.0.weight": (torch.randn(96, 32, generator=g) * 0.02).to(torch.bfloat16),
        "layers.0.bias": torch.randn(96, generator=g),
        "position_ids": torch.arange(16),
    }


def _step(state: State, seed: int, density: float = 0.03) -> State:
    return adam_like_step(state, seed, density, float_noise=1e-3)


def _chain(n: int, seed: int = 0) -> list[State]:
    states = [_model(seed)]
    for v in range(1, n):
        states.append(_step(states[-1], seed * 1000 + v))
    return states


def _same(a: State, b: State) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _publish_all(board: Board, states: list[State]) -> None:
    for v, s in enumerate(states):
        board.publish(v, s, view_name="bfloat16")


def _flip(board: Board, rel: str, edit: Callable[[bytes], bytes]) -> None:
    path = f"{board.root}/{rel}"
    board.fs.pipe_file(path, edit(board.fs.cat_file(path)))


# -- publishing ------------------------------------------------------------------------------------


def test_deltas_by_default_and_every_version_loads_bit_exact(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    # the fraction rule off: this view is so small that three patch headers are half of it
    board = make_board(anchor_every=4, anchor_fraction=1.0)
    states = _chain(9)
    _publish_all(board, states)
    kinds = [board.manifest(v).kind for v in board.versions()]
    assert kinds == [
        "anchor",
        "delta",
        "delta",
        "delta",
        "anchor",
        "delta",
        "delta",
        "delta",
        "anchor",
    ]
    m3 = board.manifest(3)
    assert m3.base == 2
    assert m3.anchor == 0
    assert m3.bytes < board.manifest(0).bytes / 5
    assert 0 < (m3.density or 0) < 0.1
    out = board.materialize(7, tmp_path / "v7")
    anchor = make_board("anchored", anchor_every=1)
    anchor.publish(7, states[7], view_name="bfloat16")
    assert (out / WEIGHTS).read_bytes() == anchor.fs.cat_file(
        f"{anchor.root}/versions/00000007/{WEIGHTS}"
    )
    reader = make_board()  # another process's view of the board
    for v, s in enumerate(states):
        manifest, view = reader.load(v)
        assert manifest.version == v
        assert _same(view, s)
        assert view["embed.weight"] is view["lm_head.weight"]


def test_anchor_when_the_chain_outgrows_a_fraction_of_the_view(make_board: MakeBoard) -> None:
    board = make_board(anchor_every=100, anchor_fraction=0.4)
    _publish_all(board, _chain(8))
    kinds = [board.manifest(v).kind for v in board.versions()]
    assert kinds[0] == "anchor"
    assert "anchor" in kinds[2:]
    assert "delta" in kinds
    for v in board.versions():
        m = board.manifest(v)
        assert m.chain_bytes <= 0.4 * m.full_bytes


def test_pointer_only_moves_forward(make_board: MakeBoard) -> None:
    board = make_board()
    states = _chain(3)
    board.publish(0, states[0], view_name="bfloat16")
    board.publish(1, states[1], view_name="bfloat16")
    with pytest.raises(BoardError, match="only moves forward"):
        board.publish(1, states[2], view_name="bfloat16")
    assert board.versions() == [0, 1]
    assert board.latest() == 1


@pytest.mark.parametrize(
    "pointer",
    [
        b'{"version": 1e400}',
        b'{"version": true}',
        b'{"version": 2.9}',
        b'{"version": 2.0}',
        b'{"version": "2"}',
        b'{"version": -1}',
        b'{"version": 9223372036854775808}',
        b'{"version": ' + b"9" * 5000 + b"}",
        b'{"digest": "x"}',
        b"[2]",
        b"not json",
        b"\xff\xfe",
        b"[" * 200_000 + b"]" * 200_000,
    ],
)
def test_a_malformed_pointer_is_refused_and_repaired_by_the_next_publish(
    make_board: MakeBoard, pointer: bytes
) -> None:
    states = _chain(2)
    board = make_board()
    board.publish(0, states[0], view_name="bfloat16")
    board.store.write(f"{board.root}/POINTER", pointer)
    with pytest.raises(PointerMalformed, match="POINTER is malformed") as info:
        make_board().latest()
    assert "\n" not in str(info.value)
    assert len(str(info.value)) < 400
    with capture_logs() as logs:
        make_board().publish(1, states[1], view_name="bfloat16")  # e.g. a restarted trainer
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["board.pointer_malformed"]
    assert make_board().latest() == 1


@pytest.mark.parametrize("version", [-1, 2**63, True])
def test_publish_refuses_a_version_the_pointer_cannot_hold(
    make_board: MakeBoard, version: int
) -> None:
    with pytest.raises(BoardError, match="not an integer in 0"):
        make_board().publish(version, _model(0), view_name="bfloat16")


@pytest.mark.parametrize(
    "run",
    [
        "../..",
        "..",
        ".",
        "",
        "a/b",
        "/abs",
        ".hidden",
        "-x",
        "a..b",
        "a b",
        "a\nb",
        "r\u00e9",
        "x" * 129,
    ],
)
def test_an_invalid_run_name_is_refused_naming_it(tmp_path: Path, run: str) -> None:
    with pytest.raises(BoardError, match="is not valid") as info:
        Board(str(tmp_path / "board"), run)
    assert repr(run)[:40] in str(info.value)
    assert not (tmp_path / "board").exists()


@pytest.mark.parametrize("run", ["demo", "run-1.v2_A", "7", "x" * 128])
def test_valid_run_names_are_accepted(tmp_path: Path, run: str) -> None:
    board = Board(str(tmp_path / "board"), run)
    board.publish(0, _model(0), view_name="bfloat16")
    assert Board(str(tmp_path / "board"), run).versions() == [0]


def test_missing_version_names_it(make_board: MakeBoard) -> None:
    with pytest.raises(BoardError, match="version 5 is not on the board"):
        make_board().manifest(5)


# -- catch-up --------------------------------------------------------------------------------------


def test_catch_up_from_ten_behind_is_short_and_bit_exact(make_board: MakeBoard) -> None:
    board = make_board(anchor_every=1000, anchor_fraction=100, catchup_levels=4)
    states = _chain(18)
    _publish_all(board, states)
    reader = make_board()
    for have, want in [(7, 17), (3, 13), (0, 10), (1, 16)]:
        plan = reader.catch_up(have, want)
        k = want - have
        assert plan.anchor is None
        assert len(plan.steps) <= math.floor(math.log2(k)) + 1, plan
        view = {n: t.clone() for n, t in states[have].items()}
        view["lm_head.weight"] = view["embed.weight"]
        reader.advance(view, have, want, verify_base=True)
        assert _same(view, states[want])
    fresh = reader.catch_up(None, 17)
    assert fresh.anchor == 0
    assert len(fresh.steps) <= 5


def test_wrong_base_is_refused_with_a_clear_error(make_board: MakeBoard) -> None:
    board = make_board()
    states = _chain(9)
    _publish_all(board, states)
    view = {n: t.clone() for n, t in states[3].items()}
    with pytest.raises(PatchBaseMismatch, match=r"from-00000005/00000\.patch: patch expects base"):
        board.advance(view, 5, 8, verify_base=True)


# -- integrity -------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_flipped_byte_in_a_stored_patch_is_detected(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    board = Board(str(tmp_path_factory.mktemp("flip")), "run", anchor_every=100)
    states = _chain(3)
    _publish_all(board, states)
    rel = "versions/00000001/from-00000000/00000.patch"
    size = len(board.fs.cat_file(f"{board.root}/{rel}"))
    pos = data.draw(st.integers(0, size - 1))
    bit = data.draw(st.integers(0, 7))
    _flip(board, rel, lambda b: b[:pos] + bytes([b[pos] ^ (1 << bit)]) + b[pos + 1 :])
    with pytest.raises(VersionCorrupt, match=r"from-00000000/00000\.patch"):
        board.load(1)


def test_flipped_truncated_or_missing_files_are_refused(make_board: MakeBoard) -> None:
    board = make_board(anchor_every=100)
    _publish_all(board, _chain(3))
    patch = "versions/00000001/from-00000000/00000.patch"
    _flip(board, patch, lambda b: b[: len(b) // 2])
    with pytest.raises(VersionCorrupt, match="damaged or truncated"):
        board.load(1)
    _flip(board, f"versions/00000000/{WEIGHTS}", lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:])
    with pytest.raises(VersionCorrupt, match="checksum mismatch"):
        board.load(0)
    _flip(board, f"versions/00000000/{WEIGHTS}", lambda b: b[: len(b) // 2])
    with pytest.raises(VersionCorrupt, match=rf"{WEIGHTS} holds \d+ bytes, its manifest records"):
        board.load(0)
    board.fs.rm(f"{board.root}/versions/00000002/from-00000001/00000.patch")
    with pytest.raises(VersionCorrupt, match="missing"):
        board.advance({}, 1, 2)
    _flip(board, "versions/00000002/manifest.json", lambda b: b.replace(b'"int64"', b'"int32"'))
    with pytest.raises(VersionCorrupt, match="manifest"):
        make_board().manifest(2)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:-40] + bytes([b[-40] ^ 0x10]) + b[-39:],  # corrupted
    ],
    ids=["truncated", "corrupted"],
)
def test_a_reader_routes_around_a_patch_that_failed_verification(
    make_board: MakeBoard, damage: Callable[[bytes], bytes]
) -> None:
    states = _chain(4)
    board = make_board(anchor_every=100)
    _publish_all(board, states)
    _flip(board, "versions/00000003/from-00000002/00000.patch", damage)
    reader = make_board()
    held = {n: t.clone() for n, t in states[2].items()}
    with pytest.raises(VersionCorrupt, match="version 3"):
        reader.advance(held, 2, 3)
    view = {n: t.clone() for n, t in states[2].items()}
    reader.advance(view, 2, 3)  # the damaged patch is not planned again: 0 → 3 instead
    assert _same(view, states[3])


def test_a_misplaced_patch_is_refused_and_routed_around(make_board: MakeBoard) -> None:
    states = _chain(4)
    board = make_board(anchor_every=100)
    _publish_all(board, states)
    other = board.fs.cat_file(f"{board.root}/versions/00000002/from-00000001/00000.patch")
    _flip(board, "versions/00000003/from-00000002/00000.patch", lambda _: other)  # reordered
    reader = make_board()
    with pytest.raises(VersionCorrupt, match=r"version 3: from-00000002/00000\.patch"):
        reader.advance({n: t.clone() for n, t in states[2].items()}, 2, 3)
    assert _same(reader.load(3)[1], states[3])


def test_a_pointer_naming_a_missing_version_is_repaired_by_the_next_publish(
    make_board: MakeBoard,
) -> None:
    states = _chain(4)
    board = make_board()
    _publish_all(board, states[:3])
    board.store.write(f"{board.root}/POINTER", b'{"version": 9}')
    reader = make_board()
    assert reader.latest() == 9
    with pytest.raises(BoardError, match="version 9"):
        reader.load(9)
    make_board().publish(3, states[3], view_name="bfloat16")  # e.g. a restarted trainer
    assert reader.latest() == 3
    assert _same(reader.load(3)[1], states[3])


def test_a_reader_racing_a_publisher_never_sees_a_partial_version(make_board: MakeBoard) -> None:
    states = _chain(10)
    digests: dict[int, str] = {}
    publisher = make_board(anchor_every=5)
    errors: list[BaseException] = []
    seen: set[int] = set()
    done = threading.Event()

    def publish() -> None:
        try:
            for v, s in enumerate(states):
                digests[v] = publisher.publish(v, s, view_name="bfloat16").digest
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            done.set()

    def read() -> None:
        reader = make_board()
        try:
            while True:
                finished = done.is_set()
                latest = reader.latest()
                if latest is not None:
                    assert latest in reader.versions()
                    manifest, view = reader.load(latest)
                    assert manifest.version == latest
                    assert _same(view, states[latest]), latest
                    seen.add(latest)
                if finished:
                    return
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert 9 in seen
    assert len(seen) >= 2


def test_a_listing_taken_mid_publish_does_not_hide_the_version_later(make_board: MakeBoard) -> None:
    states = _chain(3)
    publisher, reader = make_board(), make_board()
    _publish_all(publisher, states[:2])
    # the reader lists while version 2 is half written (its patch is there, its manifest not yet)
    publisher.store.write(f"{publisher._vdir(2)}/from-00000001/00000.patch", b"in flight")
    assert reader.versions() == [0, 1]
    publisher.publish(2, states[2], view_name="bfloat16")
    assert reader.latest() == 2
    assert _same(reader.load(2)[1], states[2])


# -- retention -------------------------------------------------------------------------------------


def test_gc_keeps_what_a_live_replica_needs(make_board: MakeBoard) -> None:
    board = make_board(anchor_every=5, anchor_fraction=100)
    states = _chain(13)
    _publish_all(board, states)
    assert board.gc(7) == list(range(5))
    assert board.versions() == list(range(5, 13))
    view = {n: t.clone() for n, t in states[7].items()}
    board.advance(view, 7, 12)  # a reader holding keep_from catches up by patches
    assert _same(view, states[12])
    assert _same(board.load(7)[1], states[7])  # a fresh reader starts at anchor 5
    with pytest.raises(BoardError, match="version 3"):
        board.load(3)


def test_retain_versions_collects_as_it_publishes(make_board: MakeBoard) -> None:
    board = make_board(anchor_every=4, anchor_fraction=100, retain_versions=3)
    _publish_all(board, _chain(10))
    assert board.versions()[0] == 4  # newest anchor at or before 9 - 3 + 1 = 7
    assert board.load(7)[0].version == 7


# -- materialize -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_materialize_after_20_trainer_steps_is_bit_identical_to_a_full_publish(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    deltas = Board(str(tmp_path / "board"), "deltas", anchor_every=1000, anchor_fraction=100)
    full = Board(str(tmp_path / "board"), "full", anchor_every=1)
    for b in (deltas, full):
        b.create(tiny_model_dir)
    for v, state in enumerate(train_states(tiny_model_dir, steps=20, lr=1e-4, seed=0)):
        served = {k: t.to(torch.bfloat16) for k, t in state.items() if k != "lm_head.weight"}
        deltas.publish(v, served, view_name="bfloat16")
        full.publish(v, dict(served), view_name="bfloat16")
    assert [deltas.manifest(v).kind for v in (0, 1, 20)] == ["anchor", "delta", "delta"]
    out = deltas.materialize(20, tmp_path / "out")
    stored = full.fs.cat_file(f"{full.root}/versions/00000020/{WEIGHTS}")
    assert (out / WEIGHTS).read_bytes() == stored
    assert (out / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    again = AutoModelForCausalLM.from_pretrained(out)
    assert again.lm_head.weight is not None


# -- credentials -----------------------------------------------------------------------------------


def test_credentials_never_reach_errors_or_logs(s3_endpoint: str) -> None:
    opts = {"key": KEY, "secret": SECRET, **s3_options(s3_endpoint)}
    board = Board("s3://no-such-bucket-sprawl/p", "run", storage_options=opts)
    with capture_logs() as logs, pytest.raises(BoardError) as info:
        board.publish(0, _model(0), view_name="bfloat16")
    assert "no-such-bucket-sprawl" in str(info.value)
    with pytest.raises(BoardError) as leaked:
        board.store.call("signing", lambda: (_ for _ in ()).throw(RuntimeError(f"{KEY}:{SECRET}")))
    for exc in (info.value, leaked.value):
        text = str(exc) + repr(logs) + repr(exc.__cause__)
        assert SECRET not in text
        assert KEY not in text
        assert exc.__cause__ is None
        assert exc.__suppress_context__
    assert "***:***" in str(leaked.value)
    assert redact("s3://user:pw@bucket/x?token=abc") == "s3://<redacted>@bucket/x?<redacted>"


# -- command line ----------------------------------------------------------------------------------


def test_versions_and_materialize_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    board = Board(str(tmp_path / "b"), "run", anchor_every=3)
    states = _chain(4)
    _publish_all(board, states)
    assert main(["versions", "--board", str(tmp_path / "b"), "--run", "run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [r["kind"] for r in rows] == ["anchor", "delta", "delta", "anchor"]
    assert rows[1]["base"] == 0
    assert 0 < rows[1]["density"] < 0.1
    assert set(rows[0]) == {
        "version", "kind", "base", "bytes", "density", "patches", "ranks", "time"
    }  # fmt: skip
    assert rows[0]["ranks"] == 1
    assert main(["versions", "--board", str(tmp_path / "b"), "--run", "run"]) == 0
    assert "delta" in capsys.readouterr().out
    out = tmp_path / "ckpt"
    args = ["materialize", "--board", str(tmp_path / "b"), "--run", "run", "--version", "2"]
    assert main([*args, "--out", str(out)]) == 0
    stored = (out / WEIGHTS).read_bytes()
    assert stored == anchor_payload(states[2])[0]
    assert main(["versions", "--board", str(tmp_path / "nothing"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == []


def test_versions_names_a_malformed_pointer_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    board = Board(str(tmp_path / "b"), "run")
    board.publish(0, _model(0), view_name="bfloat16")
    board.store.write(f"{board.root}/POINTER", b'{"version": 1e400}')
    capsys.readouterr()  # the set-up's publish logs: the command's own stderr is checked
    assert main(["versions", "--board", str(tmp_path / "b"), "--run", "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestrate: error: ")
    assert err.count("\n") == 1
    assert "POINTER is malformed" in err


def test_versions_refuses_a_run_name_outside_the_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    Board(str(tmp_path / "b" / "x" / "y"), "run").publish(0, _model(0), view_name="bfloat16")
    capsys.readouterr()  # the set-up's publish logs: the command's own stderr is checked
    assert main(["versions", "--board", str(tmp_path / "b" / "x" / "y"), "--run", "../.."]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestrate: error: run name '../..' is not valid")
    assert err.count("\n") == 1


def test_a_failed_materialize_leaves_no_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    board = Board(str(tmp_path / "b"), "run")
    _publish_all(board, _chain(2))
    _flip(board, "versions/00000001/from-00000000/00000.patch", lambda b: b[: len(b) // 2])
    out = tmp_path / "out" / "ckpt"
    args = ["materialize", "--board", str(tmp_path / "b"), "--run", "run", "--version", "1"]
    assert main([*args, "--out", str(out)]) == 2
    assert "version 1" in capsys.readouterr().err
    assert not out.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no temporary sibling left behind either
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main([*args[:-1], "0", "--out", str(out)]) == 0  # into an existing dir: files added
    assert (out / "keep.txt").read_text() == "mine"
    assert (out / WEIGHTS).read_bytes() == anchor_payload(_chain(1)[0])[0]
    assert main([*args, "--out", str(out)]) == 2  # a failure leaves the existing dir as it was
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", WEIGHTS]
    assert (out / WEIGHTS).read_bytes() == anchor_payload(_chain(1)[0])[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpt"]


def test_materialize_on_a_full_disk_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.cli import main

    board = Board(str(tmp_path / "b"), "run")
    _publish_all(board, _chain(2))
    write_bytes = Path.write_bytes

    def full(path: Path, data: bytes) -> int:
        if path.name == WEIGHTS:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() raises it
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    out = tmp_path / "out" / "ckpt"
    args = ["materialize", "--board", str(tmp_path / "b"), "--run", "run", "--version", "1"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"orchestrate: error: cannot write {out}: No space left on device"
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_bench_sparsity_reports_real_steps(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.bench import sparsity as bench_sparsity

    args = ["--model", str(tiny_model_dir), "--steps", "2", "--ks", "1,2", "--lr", "1e-5"]
    assert bench_sparsity.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert {r["view"] for r in rows} == set(bench_sparsity.VIEWS)
    assert {(r["step"], r["k"]) for r in rows} == {(1, 1), (2, 1), (2, 2)}
    for r in rows:
        assert 0 < r["changed_fraction"] < 0.5
        assert 0 < r["patch_bytes"] < r["full_bytes"]
    k2 = next(r for r in rows if r["k"] == 2 and r["view"] == "bf16")
    k1 = [r for r in rows if r["k"] == 1 and r["view"] == "bf16"]
    assert k2["changed_fraction"] > max(r["changed_fraction"] for r in k1)
