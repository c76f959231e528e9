"""A slow link between the board and an island, for the benchmarks that sync over one.

:class:`Link` is a serial link of a given bandwidth and round trip; :class:`ThrottledBoard` is a
reader's board whose every read crosses one, so a sync's time follows the bytes it actually
fetches. Reads asked for together overlap their round trips, as requests in flight to an object
store do. :func:`add_link_flags` and :func:`parse_flags` are the flags of every sync benchmark
(``bench sync``, ``bench sync --engine``), checked before anything runs.
"""

from __future__ import annotations

import argparse
import threading
import time

from policies.board import Board


class Link:
    """A serial link of ``mbit_s`` Mbit/s with a round trip of ``rtt_ms``: a read's bytes start
    crossing one round trip after it was asked for, and only once the link has carried every
    earlier read's; reads asked for together overlap their round trips (as requests in flight to
    an object store do). A read of nothing there costs its round trip."""

    def __init__(self, mbit_s: float, rtt_ms: float = 0.0) -> None:
        self.rate = mbit_s * 1e6 / 8
        self.rtt = rtt_ms / 1e3
        self.bytes = 0
        self._lock = threading.Lock()
        self._free_at = 0.0

    def carry(self, nbytes: int | None, asked: float | None = None) -> None:
        """Return once ``nbytes`` (None: an answer that the object is not there), asked for at
        ``asked`` (a ``time.perf_counter()``; default now), have crossed the link."""
        with self._lock:
            answer = (time.perf_counter() if asked is None else asked) + self.rtt
            done = answer
            if nbytes is not None:
                self._free_at = done = max(answer, self._free_at) + nbytes / self.rate
                self.bytes += nbytes
        time.sleep(max(0.0, done - time.perf_counter()))


class ThrottledBoard(Board):
    """A reader's board whose every read crosses ``link``."""

    def __init__(self, url: str, run: str, link: Link) -> None:
        super().__init__(url, run)
        self.link = link

    def _read(self, path: str, limit: int) -> bytes:
        asked = time.perf_counter()
        try:
            data = super()._read(path, limit)
        except FileNotFoundError:
            self.link.carry(None, asked)
            raise
        self.link.carry(len(data), asked)
        return data


def add_link_flags(parser: argparse.ArgumentParser, poll_ms: float) -> None:
    """The flags of a sync over a :class:`Link` (``bench sync``, ``bench sync --engine``)."""
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--link-mbit", type=float, default=100.0)
    parser.add_argument(
        "--link-rtt-ms",
        type=float,
        default=0.0,
        help="round trip of every read (an object store in another region: 50-150)",
    )
    parser.add_argument("--poll-ms", type=float, default=poll_ms)


def parse_flags(
    parser: argparse.ArgumentParser, argv: list[str], counts: tuple[str, ...]
) -> argparse.Namespace:
    """``argv`` parsed, every flag of :func:`add_link_flags` and each of ``counts`` (at least
    1) checked: a bad value is a usage error naming its flag."""
    args = parser.parse_args(argv)
    for flag in counts:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1")
    for flag in ("link_mbit", "poll_ms"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')}: must be > 0")
    if not args.link_rtt_ms >= 0:
        parser.error("--link-rtt-ms: must be >= 0")
    if not 0 < args.density <= 1:
        parser.error("--density: must be in (0, 1]")
    return args
