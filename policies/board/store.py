"""The board's storage edge: whole-object reads and atomic writes on any fsspec filesystem.

Guarantees: :meth:`Store.write` makes an object appear whole or not at all (local: temp file in
the same directory + fsync + rename + directory fsync; object stores: one PUT); :meth:`Store.read`
returns the object's bytes as stored, never more than the caller's limit plus one
(``FileNotFoundError`` if absent; locally, anything but a regular file is refused, never waited
on); every other storage
failure becomes :class:`BoardError` whose message — the object's path and the backend's error
included — has the URL's credentials (user, password, query string), configured secrets and
``AWS_*`` credentials from the environment removed, and which does not chain the original
exception (tracebacks cannot leak it either).

Every call to an ``s3://`` board is bounded: a connection must open within
:data:`S3_CONNECT_TIMEOUT_S` and a response must not stall for :data:`S3_READ_TIMEOUT_S` (each
read of the socket, so a large object that keeps arriving is never cut), and a call is tried at
most :data:`S3_MAX_ATTEMPTS` times (botocore's ``standard`` retry mode, with its backoff: failed
connections, timeouts, throttling and 5xx answers), s3fs's own retry loop being off. A store that
hangs (a paused server: the kernel accepts the connection, nothing answers) therefore costs a
call at most ``3 × 15 s`` plus ~3 s of backoff before it is a :class:`BoardError`; unbounded, a
read was tried 125 times (s3fs's retries, nested twice, around botocore's), 308 s with a 1 s
read timeout and over half an hour with 15 s. ``storage_options["config_kwargs"]`` (botocore's
``Config``) overrides any of these fields.

Not covered: listing consistency on eventually consistent stores beyond what the store offers
(fsspec's listings cache is off unless ``storage_options`` turn it on).
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import fsspec

from policies.board import failpoints
from policies.errors import BoardError, PolicyError, VersionCorrupt

T = TypeVar("T")
_SECRET_KEYS = ("key", "secret", "token", "password")
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


S3_CONNECT_TIMEOUT_S = 5.0
"""Seconds an ``s3://`` board's call waits for a connection (``config_kwargs.connect_timeout``)."""
S3_READ_TIMEOUT_S = 15.0
"""Seconds an ``s3://`` board's call waits for the next bytes of a response
(``config_kwargs.read_timeout``)."""
S3_MAX_ATTEMPTS = 3
"""Tries of one ``s3://`` board call, the first included (``config_kwargs.retries``)."""

_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][\w+.-]*://)[^/@\s]+@")
_QUERY = re.compile(r"\?\S*")


def redact(text: str) -> str:
    """``text`` with URL credentials (``user:pass@``) and query strings (signed tokens) replaced
    by ``<redacted>``, so board URLs can be logged and put in error messages."""
    return _QUERY.sub("?<redacted>", _CREDENTIALS.sub(r"\g<scheme><redacted>@", text))


def _flatten(d: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    for k, v in d.items():
        if isinstance(v, Mapping):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _s3_config() -> dict[str, object]:
    """botocore ``Config`` fields that bound every call (module docstring)."""
    return {
        "connect_timeout": S3_CONNECT_TIMEOUT_S,
        "read_timeout": S3_READ_TIMEOUT_S,
        "retries": {"mode": "standard", "total_max_attempts": S3_MAX_ATTEMPTS},
    }


def _read_regular(path: str, most: int) -> bytes:
    """At most ``most`` bytes of the local file ``path``, which must be a regular file: a FIFO,
    a device or a socket put in an object's place is refused, never waited on (opened without
    blocking, checked on the open descriptor)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise VersionCorrupt(f"{redact(path)} is not a regular file")
        chunks: list[bytes] = []
        left = most
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class Store:
    """Objects under one root of an fsspec URL."""

    def __init__(self, url: str, storage_options: Mapping[str, object] | None = None) -> None:
        self.safe_url = redact(url)
        # Another process publishes under us: a cached listing would hide versions written
        # after it (fsspec answers "not found" from a parent listing it holds), so none is kept.
        options = {"use_listings_cache": False, **dict(storage_options or {})}
        s3 = fsspec.core.split_protocol(url)[0] in ("s3", "s3a")
        if s3:
            given = options.get("config_kwargs")
            options["config_kwargs"] = _s3_config() | (given if isinstance(given, dict) else {})
        self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        if s3:  # botocore retries (above); s3fs's own loop would multiply them (5 × 5 for reads)
            self.fs.retries = 1
        self.root = self.root.rstrip("/")
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        self.local = any(p in ("file", "local") for p in protocols)
        self.bytes_read = 0
        """Bytes read from the board so far (what crossed the link, for a remote board)."""
        # the URL's own credentials too: the backend may keep them in its paths (s3fs takes
        # ``s3://key:secret@bucket`` for a bucket name) and echo them in its errors
        split = urlsplit(url)
        self._secrets = [
            str(v)
            for k, v in _flatten(storage_options or {})
            if any(s in k.lower() for s in _SECRET_KEYS) and v
        ] + [os.environ[k] for k in _SECRET_ENV if os.environ.get(k)]
        if split.scheme and split.netloc:
            self._secrets += [s for s in (split.username, split.password, split.query) if s]

    def _scrub(self, text: str) -> str:
        """``text`` with every secret the URL, the storage options or the environment hold
        replaced by ``***``."""
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run a storage call; convert third-party failures to :class:`BoardError` (scrubbed)."""
        try:
            return fn()
        except (FileNotFoundError, PolicyError):
            raise
        except Exception as exc:  # any fsspec backend's error: converted at the edge
            msg = f"{what} failed: {type(exc).__name__}: {exc}"
            raise BoardError(f"board {self.safe_url}: {self._scrub(msg)}") from None

    def read(self, path: str, limit: int) -> bytes:
        """The object's bytes, at most ``limit + 1`` of them: a result longer than ``limit``
        means the object is larger (the caller refuses it), and a file that never ends
        (``/dev/zero`` behind a symlink) costs no more than that."""
        if self.local:
            data = self.call(f"reading {path}", lambda: _read_regular(path, limit + 1))
        else:
            data = self.call(
                f"reading {path}", lambda: self.fs.cat_file(path, start=0, end=limit + 1)
            )
        self.bytes_read += len(data)
        return data

    def write(self, path: str, data: bytes) -> None:
        data = failpoints.mutate("board.write", path, data)
        try:
            self.call(f"writing {path}", lambda: self._put(path, data))
        except FileNotFoundError:  # a missing bucket or directory: the board is unusable
            msg = f"writing {path} failed: not found"
            raise BoardError(f"board {self.safe_url}: {self._scrub(msg)}") from None

    def _put(self, path: str, data: bytes) -> None:
        if not self.local:
            self.fs.pipe_file(path, data)  # one PUT: the object appears whole or not at all
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(Path(path).parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def dirs_with(self, root: str, name: str) -> list[str]:
        """Names of the subdirectories of ``root`` that hold an object ``name``."""

        def scan() -> list[str]:
            if self.local:
                return [d for d in os.listdir(root) if os.path.exists(f"{root}/{d}/{name}")]
            out = []
            for path in self.fs.find(root):
                parts = str(path).rsplit("/", 2)
                if len(parts) == 3 and parts[2] == name:
                    out.append(parts[1])
            return out

        return self.call(f"listing {root}", scan)

    def remove_dir(self, path: str, first: str) -> None:
        """Delete ``path/first``, then the rest of ``path``."""

        def rm() -> None:
            self.fs.rm(f"{path}/{first}")
            self.fs.rm(path, recursive=True)

        self.call(f"deleting {path}", rm)
