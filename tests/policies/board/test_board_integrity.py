"""What a version's seal covers: base files, patch names and sizes; and boards of the old format."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from policies.board import WEIGHTS, Board, Manifest, PatchRef
from policies.board.manifest import file_entries, manifest_seal
from policies.board.types import FORMAT, ChunkRef
from policies.errors import BoardError, BoardFormatError, VersionCorrupt

MakeBoard = Callable[..., Board]
MANIFEST_1 = "versions/00000001/manifest.json"


def _view(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.weight": torch.randn(96, 32, generator=g).to(torch.bfloat16),
    }


def _model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 10000.0}))
    (root / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    return root


def _published(make_board: MakeBoard, tmp_path: Path, versions: int = 2) -> Board:
    board = make_board(anchor_every=100)
    board.create(_model_dir(tmp_path / "model"))
    view = _view(0)
    for v in range(versions):
        view = {k: (t + 0.0625 * v).to(t.dtype) for k, t in view.items()}
        board.publish(v, view, view_name="bfloat16")
    return board


def _edit(board: Board, rel: str, edit: Callable[[bytes], bytes]) -> None:
    path = f"{board.root}/{rel}"
    board.fs.pipe_file(path, edit(board.fs.cat_file(path)))


def _edit_manifest(board: Board, rel: str, edit: Callable[[dict[str, Any]], None]) -> None:
    def apply(raw: bytes) -> bytes:
        body = json.loads(raw)
        edit(body)
        return json.dumps(body).encode()

    _edit(board, rel, apply)


def _resealed(body: dict[str, Any]) -> None:
    """Seal ``body`` again, as a writer that knows the format would (names left unvalidated)."""
    patches = [
        PatchRef.model_construct(**{**p, "chunks": [ChunkRef(**c) for c in p.get("chunks", [])]})
        for p in body["patches"]
    ]
    built = Manifest.model_validate({**body, "patches": []}).model_copy(update={"patches": patches})
    body["seal"] = manifest_seal(built)


# -- base files (#19 item 12) ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_tampered_base_file_is_refused_naming_it(
    make_board: MakeBoard, tmp_path: Path, name: str
) -> None:
    board = _published(make_board, tmp_path)
    _edit(board, f"base/{name}", lambda b: b.replace(b"0", b"1"))
    reader = make_board()
    assert reader.base_files()[name] != (tmp_path / "model" / name).read_bytes()
    for version in (0, 1):
        with pytest.raises(VersionCorrupt, match=rf"version {version}: base file base/{name} does"):
            reader.load(version)
    with pytest.raises(VersionCorrupt, match=rf"base/{name}"):
        reader.advance({}, None, 1)


def test_base_files_added_or_removed_after_publishing_are_refused(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    board = _published(make_board, tmp_path)
    board.store.write(f"{board.root}/base/chat_template.jinja", b"{{ messages }}")
    reader = make_board()
    assert "chat_template.jinja" in reader.base_files()
    with pytest.raises(VersionCorrupt, match=r"base/chat_template\.jinja is not recorded"):
        reader.load(1)
    board.fs.rm(f"{board.root}/base/chat_template.jinja")
    board.fs.rm(f"{board.root}/base/tokenizer.json")
    reader = make_board()
    assert sorted(reader.base_files()) == ["config.json"]
    with pytest.raises(VersionCorrupt, match=r"base/tokenizer\.json is recorded .* missing"):
        reader.load(1)


def test_intact_base_files_load_and_are_what_create_copied(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    board = _published(make_board, tmp_path)
    reader = make_board()
    base = reader.base_files()
    assert base == {n: (tmp_path / "model" / n).read_bytes() for n in base}
    assert sorted(base) == ["config.json", "tokenizer.json"]
    assert sorted(reader.manifest(1).base_files) == ["config.json", "tokenizer.json"]
    reader.load(1)
    # create() makes base/ hold exactly the model dir's files: a stale one is removed
    (tmp_path / "model" / "tokenizer.json").unlink()
    board.create(tmp_path / "model")
    assert sorted(make_board().base_files()) == ["config.json"]


def test_the_seal_covers_base_file_records(make_board: MakeBoard, tmp_path: Path) -> None:
    board = _published(make_board, tmp_path)
    _edit(board, "base/config.json", lambda b: b.replace(b"10000", b"20000"))
    fake = json.loads(board.fs.cat_file(f"{board.root}/base/config.json"))
    assert fake["rope_theta"] == 20000.0

    def record_tampered(body: dict[str, Any]) -> None:  # the record made to fit, seal left
        entry = file_entries({"c": json.dumps(fake).encode()})["c"]
        body["base_files"]["config.json"] = entry.model_dump()

    _edit_manifest(board, MANIFEST_1, record_tampered)
    with pytest.raises(VersionCorrupt, match="version 1: manifest does not match its own digest"):
        make_board().manifest(1)


def test_materialize_refuses_a_version_whose_base_files_were_tampered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    board = _published(lambda **kw: Board(str(tmp_path / "b"), "run", **kw), tmp_path)
    _edit(board, "base/config.json", lambda b: b.replace(b"10000", b"20000"))
    out = tmp_path / "ckpt"
    args = ["materialize", "--board", str(tmp_path / "b"), "--run", "run", "--version", "1"]
    capsys.readouterr()  # the set-up's publish logs: the command's own stderr is checked
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "orchestrate: error: version 1: base file base/config.json does not match its manifest"
    )
    assert err.count("\n") == 1
    assert not out.exists()


# -- patch names and sizes (#19 item 13) -----------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["../00000000/model.safetensors", "/etc/passwd", "sub/from-00000000.patch", "..", ""]
)
def test_a_patch_name_outside_its_version_directory_is_refused(
    make_board: MakeBoard, tmp_path: Path, name: str
) -> None:
    board = _published(make_board, tmp_path)

    def rename(body: dict[str, Any]) -> None:
        body["patches"][0]["file"] = name
        _resealed(body)

    _edit_manifest(board, MANIFEST_1, rename)
    reader = make_board()
    with pytest.raises(VersionCorrupt, match=r"version 1: manifest unreadable: .*patch file name"):
        reader.manifest(1)
    with pytest.raises(VersionCorrupt, match="version 1"):
        reader.load(1)
    assert reader.load(0)[0].version == 0


def test_the_seal_covers_patch_names_and_sizes(make_board: MakeBoard, tmp_path: Path) -> None:
    board = _published(make_board, tmp_path, versions=3)

    def grow(body: dict[str, Any]) -> None:
        body["patches"][0]["bytes"] += 1  # a valid record, not sealed

    _edit_manifest(board, MANIFEST_1, grow)
    with pytest.raises(VersionCorrupt, match="version 1: manifest does not match its own digest"):
        make_board().manifest(1)

    def swap(body: dict[str, Any]) -> None:  # the squashed patch 0 → 2 recorded as the delta
        body["patches"][1]["file"] = body["patches"][0]["file"]

    _edit_manifest(board, "versions/00000002/manifest.json", swap)
    with pytest.raises(VersionCorrupt, match=r"version 2: manifest unreadable: .*patch file name"):
        make_board().manifest(2)


def test_a_patch_larger_than_its_record_is_refused_after_reading_only_that_much(
    tmp_path: Path,
) -> None:
    board = _published(lambda **kw: Board(str(tmp_path / "b"), "run", **kw), tmp_path)
    patch = Path(board.root) / "versions" / "00000001" / "from-00000000" / "00000.patch"
    size = patch.stat().st_size
    patch.write_bytes(patch.read_bytes() + b"\0" * (4 << 20))  # longer than its record
    reader = Board(str(tmp_path / "b"), "run")
    with pytest.raises(VersionCorrupt, match=rf"00000\.patch holds more than {size} bytes"):
        reader.advance(reader.load(0)[1], 0, 1)
    assert reader.store.bytes_read < (1 << 20)  # the anchor's view, the manifests, one byte over
    anchor = Path(board.root) / "versions" / "00000000" / WEIGHTS
    anchor.unlink()
    os.symlink("/dev/zero", anchor)  # a file that never ends: not a regular file, not read
    reader = Board(str(tmp_path / "b"), "run")
    with pytest.raises(VersionCorrupt, match=rf"{WEIGHTS} is not a regular file"):
        reader.load(0)
    assert reader.store.bytes_read < 64 * 1024  # the manifests only


def test_a_shorter_patch_is_refused_as_truncated(make_board: MakeBoard, tmp_path: Path) -> None:
    board = _published(make_board, tmp_path)
    _edit(board, "versions/00000001/from-00000000/00000.patch", lambda b: b[:-1])
    reader = make_board()
    with pytest.raises(
        VersionCorrupt, match=r"holds \d+ bytes, its manifest records \d+ \(damaged"
    ):
        reader.advance(reader.load(0)[1], 0, 1)


def test_an_endless_pointer_or_manifest_is_refused(tmp_path: Path) -> None:
    board = _published(lambda **kw: Board(str(tmp_path / "b"), "run", **kw), tmp_path)
    manifest = Path(board.root) / MANIFEST_1
    manifest.unlink()
    os.symlink("/dev/zero", manifest)  # never ends: not a regular file, not read at all
    with pytest.raises(VersionCorrupt, match=r"manifest\.json is not a regular file"):
        Board(str(tmp_path / "b"), "run").manifest(1)
    pointer = Path(board.root) / "POINTER"
    pointer.unlink()
    os.symlink("/dev/zero", pointer)
    with pytest.raises(BoardError, match=r"POINTER is not a regular file"):
        Board(str(tmp_path / "b"), "run").latest()
    pointer.unlink()
    pointer.write_bytes(b" " * (1 << 20))  # a regular file past the limit: read that far only
    reader = Board(str(tmp_path / "b"), "run")
    with pytest.raises(BoardError, match=r"POINTER is malformed \(larger than 4096 bytes\)"):
        reader.latest()
    assert reader.store.bytes_read == 4097


# -- boards written by an older sprawl -------------------------------------------------------------


def _as_format_1(body: dict[str, Any]) -> None:
    """The manifest as sprawl wrote it before format 2: no format, base files or seal."""
    for key in ("format", "base_files", "seal"):
        del body[key]


def test_a_board_of_the_previous_format_is_refused_saying_how_to_proceed(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    board = _published(make_board, tmp_path)
    for v in (0, 1):
        _edit_manifest(board, f"versions/{v:08d}/manifest.json", _as_format_1)
    reader = make_board()
    with pytest.raises(BoardFormatError, match=r"version 1 on .* written by an older sprawl") as e:
        reader.load(1)
    assert "board format 1" in str(e.value)
    assert "publish a new run" in str(e.value)
    with pytest.raises(BoardFormatError, match="older sprawl"):  # not taken for a dangling pointer
        make_board().publish(2, _view(3), view_name="bfloat16")


def test_a_board_of_a_newer_format_is_refused(make_board: MakeBoard, tmp_path: Path) -> None:
    board = _published(make_board, tmp_path)

    def newer(body: dict[str, Any]) -> None:
        body["format"] = FORMAT + 1
        body["something_new"] = True

    _edit_manifest(board, MANIFEST_1, newer)
    with pytest.raises(BoardFormatError, match=r"written by a newer sprawl .*upgrade sprawl"):
        make_board().manifest(1)


def test_a_manifest_of_a_format_before_this_one_is_refused_not_misread(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    """Formats 2–7 (unreleased) are not read: the version is named as written by an older
    sprawl, even where its fields would parse (format 7's patches are of the codec's format 2,
    which does not vouch for the base words it changes)."""
    board = _published(make_board, tmp_path)
    for old in (5, 7):

        def older(body: dict[str, Any], fmt: int = old) -> None:
            body["format"] = fmt

        _edit_manifest(board, MANIFEST_1, older)
        with pytest.raises(
            BoardFormatError, match=rf"board format {old}; this sprawl reads format 8"
        ):
            make_board().manifest(1)


def test_versions_command_names_an_old_format_board_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    board = _published(lambda **kw: Board(str(tmp_path / "b"), "run", **kw), tmp_path)
    _edit_manifest(board, "versions/00000000/manifest.json", _as_format_1)
    capsys.readouterr()  # the set-up's publish logs: the command's own stderr is checked
    assert main(["versions", "--board", str(tmp_path / "b"), "--run", "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestrate: error: version 0 on ")
    assert "written by an older sprawl" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "rel", ["POINTER", MANIFEST_1, "versions/00000001/from-00000000/00000.patch", "STREAM"]
)
def test_a_fifo_in_an_object_s_place_is_refused_not_waited_on(tmp_path: Path, rel: str) -> None:
    """(a reader blocked forever on the FIFO: a live server then never applied later versions)"""
    board = Board(str(tmp_path / "board"), "run", anchor_every=100)
    board.create(_model_dir(tmp_path / "model"))
    view = _view(0)
    for v in range(2):
        view = {k: (t + 0.0625 * v).to(t.dtype) for k, t in view.items()}
        board.publish(v, view, view_name="bfloat16")
    path = Path(board.root) / rel
    path.unlink()
    os.mkfifo(path)
    reader = Board(str(tmp_path / "board"), "run")
    with pytest.raises(VersionCorrupt, match="not a regular file"):
        reader.store.read(str(path), 1 << 20)
    if rel == "STREAM":  # what a reader does with it: nothing is streamed (logged)
        assert reader.stream() is None
    elif rel == "POINTER":
        with pytest.raises(BoardError):
            reader.latest()
    else:
        with pytest.raises(VersionCorrupt, match="not a regular file"):
            reader.load(1)


def test_a_version_directory_named_with_a_non_ascii_digit_is_ignored(
    make_board: MakeBoard, tmp_path: Path
) -> None:
    """(``'²'.isdigit()`` is true and ``int('²')`` raises: listing versions crashed)"""
    board = _published(make_board, tmp_path)
    board.fs.makedirs(f"{board.root}/versions/²", exist_ok=True)
    board.fs.pipe_file(f"{board.root}/versions/²/manifest.json", b"{}")
    assert make_board().versions() == [0, 1]
