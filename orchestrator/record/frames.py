"""Crash-safe frames: the storage of the trajectory log and the event log.

A *stream* (``episodes``, ``batches``, ``events``) is a sequence of part files
``<stream>-NNNNNN.jsonl.zst`` in one directory; each part is a sequence of independent zstd
frames (checksummed, content size in the header), one per :meth:`FrameWriter.write` call, each
holding JSON lines. Every complete part is therefore an ordinary ``.jsonl.zst`` file
(``zstd -dc``, ``datasets.load_dataset("json", …)``).

Guarantees:

- Append-only: a writer never rewrites a frame; it opens a new part when the current one reaches
  ``rotate_bytes`` and a new part every time it is opened, so a restart never appends after
  damage.
- Crash-safe: a frame is written with one ``write`` and flushed, so a SIGKILL leaves at most one
  torn frame, at the end of a part. Readers accept a frame only once the decoder reaches its end
  and its checksum matches, so a torn tail is detected (logged as ``trajlog.torn_tail``) and
  skipped, and every complete record before it is read. A damaged frame that is *not* a tail is
  corruption and raises :class:`~orchestrator.errors.TrajlogError`.
- :func:`repair` truncates torn tails, after which every part loads with plain ``datasets``.
- Hostile files are bounded: a part is read only if it is a regular file (a FIFO or device in its
  place is refused, never waited on); a frame decompressing to more than
  :data:`MAX_FRAME_BYTES` (a zstd bomb) and a line that is not a JSON object are
  :class:`~orchestrator.errors.TrajlogError` naming the part. A writer never writes a frame over
  that bound: a larger write is split into several frames at record boundaries.

Not covered: durability across power loss (frames are flushed to the kernel, not fsync'ed unless
``fsync=True``); concurrent writers to one directory.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

import structlog
import zstandard

from orchestrator.errors import TrajlogError

log = structlog.get_logger(__name__)

Stream = Literal["episodes", "batches", "events"]
PART_SUFFIX = ".jsonl.zst"
_CHUNK = 1 << 10
"""Compressed bytes fed to the decoder at a time: a zstd block of 4 bytes may decode to 128 KiB,
so one call yields at most ~32 MiB and a bomb is stopped near :data:`MAX_FRAME_BYTES`."""
MAX_FRAME_BYTES = 512 << 20
"""The most one frame decompresses to (a reader refuses more: a zstd bomb, not a log)."""


def part_name(stream: str, index: int) -> str:
    return f"{stream}-{index:06d}{PART_SUFFIX}"


def parts(directory: Path, stream: str) -> list[Path]:
    """The part files of ``stream`` in ``directory``, oldest first."""
    return sorted(directory.glob(f"{stream}-[0-9]*{PART_SUFFIX}"))


class FrameWriter:
    """Appends JSON records to ``<directory>/<stream>-NNNNNN.jsonl.zst``, one frame per call."""

    def __init__(
        self,
        directory: Path,
        stream: str,
        *,
        rotate_bytes: int = 64 << 20,
        level: int = 3,
        fsync: bool = False,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.stream = stream
        self.rotate_bytes = rotate_bytes
        self.fsync = fsync
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
        existing = parts(directory, stream)
        self._index = int(existing[-1].name[len(stream) + 1 :][:6]) + 1 if existing else 0
        self._f: IO[bytes] | None = None
        self._size = 0

    def _open(self) -> IO[bytes]:
        path = self.directory / part_name(self.stream, self._index)
        self._index += 1
        self._size = 0
        self._f = path.open("xb")
        return self._f

    def write(self, records: list[dict[str, Any]]) -> None:
        """Write ``records`` as one frame (all or none of them survive a crash)."""
        if not records:
            return
        payload = b"".join(
            json.dumps(r, separators=(",", ":"), allow_nan=False).encode() + b"\n" for r in records
        )
        if len(payload) > MAX_FRAME_BYTES:
            if len(records) == 1:
                raise TrajlogError(
                    f"a {self.stream} record of {len(payload)} bytes is larger than a frame may "
                    f"hold ({MAX_FRAME_BYTES})"
                )
            half = len(records) // 2
            self.write(records[:half])
            self.write(records[half:])
            return
        if self._f is None or self._size >= self.rotate_bytes:
            self.close()
            self._open()
        f = self._f
        assert f is not None
        frame = self._cctx.compress(payload)
        f.write(frame)
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        self._size += len(frame)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def scan_frames(data: bytes) -> tuple[list[bytes], int]:
    """The decoded payload of every complete frame in ``data``, and the byte offset where the
    complete frames end (``len(data)`` unless the tail is torn).

    Raises :class:`TrajlogError` when a frame is corrupt (bad magic, bad checksum).
    """
    payloads: list[bytes] = []
    pos = 0
    dctx = zstandard.ZstdDecompressor()
    while pos < len(data):
        d = dctx.decompressobj()
        chunks: list[bytes] = []
        fed, held = pos, 0
        try:
            while not d.eof and fed < len(data):
                chunk = data[fed : fed + _CHUNK]
                fed += len(chunk)
                chunks.append(d.decompress(chunk))
                held += len(chunks[-1])
                if held > MAX_FRAME_BYTES:
                    raise TrajlogError(
                        f"the frame at byte {pos} decompresses to more than {MAX_FRAME_BYTES} "
                        "bytes: not a frame sprawl writes"
                    )
        except zstandard.ZstdError as exc:
            raise TrajlogError(f"corrupt frame at byte {pos}: {exc}") from exc
        if not d.eof:
            return payloads, pos
        pos = fed - len(d.unused_data)
        payloads.append(b"".join(chunks))
    return payloads, pos


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its owner only (mode 0600 from its creation), replacing
    it atomically: for files that may hold what a config holds (``config.json``, ``run.json``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def read_regular(path: Path) -> bytes:
    """The bytes of ``path``, which must be a regular file (a FIFO, device or socket in its place
    is :class:`TrajlogError`, never waited on: opened without blocking, checked on the open
    descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TrajlogError(f"{path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TrajlogError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _record(path: Path, line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise TrajlogError(f"{path}: a line is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise TrajlogError(f"{path}: a line is not a JSON object")
    return record


def read_part(path: Path) -> Iterator[dict[str, Any]]:
    """Every record of one part (``.jsonl.zst`` or plain ``.jsonl``), skipping a torn tail."""
    data = read_regular(path)
    if path.suffix == ".jsonl":
        lines = data.split(b"\n")
        torn = lines.pop()
        if torn:
            log.warning("trajlog.torn_tail", part=str(path), bytes=len(torn))
        for line in lines:
            yield _record(path, line)
        return
    try:
        payloads, end = scan_frames(data)
    except TrajlogError as exc:
        raise TrajlogError(f"{path}: {exc}") from None
    if end < len(data):
        log.warning("trajlog.torn_tail", part=str(path), offset=end, bytes=len(data) - end)
    for payload in payloads:
        for line in payload.splitlines():
            yield _record(path, line)


def iter_records(path: Path, stream: Stream | None = None) -> Iterator[dict[str, Any]]:
    """Records of a log: ``path`` is a log directory (every stream, or only ``stream``) or one
    part file. Within a stream, records come in write order."""
    if path.is_file():
        yield from read_part(path)
        return
    if not path.is_dir():
        raise TrajlogError(f"{path}: no trajectory log here")
    for name in (stream,) if stream else ("episodes", "batches"):
        for part in parts(path, name):
            yield from read_part(part)


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete episode and batch record of a log (directory or part file)."""
    return list(iter_records(path))


def repair(directory: Path) -> list[Path]:
    """Truncate every part's torn tail so each is a valid ``.jsonl.zst``; returns parts changed."""
    changed = []
    for part in sorted(directory.glob(f"*{PART_SUFFIX}")):
        data = read_regular(part)
        _, end = scan_frames(data)
        if end < len(data):
            with part.open("r+b") as f:
                f.truncate(end)
            changed.append(part)
            log.warning("trajlog.repaired", part=str(part), dropped_bytes=len(data) - end)
    return changed


# -- records ------------------------------------------------------------------------------------
