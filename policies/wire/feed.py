"""The batch feed's client: what a trainer calls to pull batches and acknowledge its steps.

The protocol (served by :mod:`orchestrator.loop.feed` when ``trainer.mode = "feed"``)::

    client = FeedClient.discover(run_dir)      # $SPRAWL_FEED_URL / $SPRAWL_FEED_TOKEN, or feed.json
    while (batch := client.next(wait_s=30)) is None:
        pass                                   # none ready yet: ask again
    ...                                        # train on batch, publish batch.version + 1
    client.ack(batch.version, {"loss": 0.5})   # after the publish: the step is done

A batch that was not acknowledged is delivered again, the same content, to the next ``next``
(a restarted trainer takes the step it lost); one that was is never delivered again. Ack after
the board shows ``version + 1``: the feed refuses an earlier one.

Errors: :class:`~policies.errors.FeedUnavailable` when the feed cannot be reached (not started
yet, restarting: worth retrying), :class:`~policies.errors.FeedError` for a refusal (a wrong
token, an ack of a batch that is not out for training); both name the URL. Synchronous, on the
standard library's ``urllib`` (a trainer's step loop is synchronous; no event loop needed).
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from policies.errors import FeedError, FeedUnavailable
from policies.wire.batches import BatchFile

FEED_FILE = "feed.json"
"""The file in the run directory that names the feed's URL and token (mode 0600)."""
URL_ENV = "SPRAWL_FEED_URL"
TOKEN_ENV = "SPRAWL_FEED_TOKEN"


@dataclass(frozen=True)
class FeedAddress:
    """Where the feed listens, and its bearer token."""

    url: str
    token: str


def feed_address(run_dir: Path | None = None) -> FeedAddress:
    """The feed from ``$SPRAWL_FEED_URL`` and ``$SPRAWL_FEED_TOKEN`` when both are set, else from
    ``<run_dir>/feed.json``; :class:`FeedUnavailable` when that file is not there (yet)."""
    url, token = os.environ.get(URL_ENV), os.environ.get(TOKEN_ENV)
    if url and token:
        return FeedAddress(url.rstrip("/"), token)
    if run_dir is None:
        raise FeedError(f"no batch feed: set ${URL_ENV} and ${TOKEN_ENV}, or give the run dir")
    path = run_dir / FEED_FILE
    try:
        written = json.loads(path.read_text())
        return FeedAddress(str(written["url"]).rstrip("/"), str(written["token"]))
    except FileNotFoundError:
        raise FeedUnavailable(f"{path}: not written yet (the orchestrator writes it)") from None
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise FeedError(f"{path}: unreadable feed address: {exc}") from None


class FeedClient:
    """A trainer's connection to the batch feed at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    @classmethod
    def discover(cls, run_dir: Path | None = None, *, timeout_s: float = 30.0) -> FeedClient:
        """The feed named by the environment or the run directory (:func:`feed_address`)."""
        address = feed_address(run_dir)
        return cls(address.url, address.token, timeout_s=timeout_s)

    def next(self, wait_s: float | None = None) -> BatchFile | None:
        """The batch for the trainer's next version, or None when none is ready within
        ``wait_s`` seconds (None: the feed's default long poll, 20 s)."""
        query = "" if wait_s is None else f"?wait_s={wait_s:g}"
        wait = 20.0 if wait_s is None else wait_s
        status, body = self._call("GET", f"/v1/batches/next{query}", None, wait)
        if status == 204:
            return None
        try:
            return BatchFile.model_validate_json(body)
        except ValidationError as exc:
            msg = f"{self.url}: the feed sent a batch this sprawl cannot read: {exc}"
            raise FeedError(msg) from None

    def ack(self, version: int, metrics: Mapping[str, float] | None = None) -> None:
        """Batch ``version`` is trained and version ``version + 1`` published; ``metrics`` (flat,
        finite floats) are logged with the step. Acknowledging twice is harmless."""
        values = dict(metrics or {})
        bad = sorted(k for k, v in values.items() if not math.isfinite(v))
        if bad:
            raise FeedError(f"metrics {', '.join(bad)}: not finite (JSON has no NaN or inf)")
        body = json.dumps({"metrics": values}).encode()
        self._call("POST", f"/v1/batches/{version}/ack", body, 0.0)

    def _call(self, method: str, path: str, body: bytes | None, wait_s: float) -> tuple[int, bytes]:
        url = self.url + path
        request = urllib.request.Request(
            url,
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s + wait_s) as response:
                return int(response.status), bytes(response.read())
        except urllib.error.HTTPError as exc:
            raise _refusal(method, url, exc) from None
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            reason = getattr(exc, "reason", exc)
            raise FeedUnavailable(f"cannot reach the batch feed at {url}: {reason}") from None


def _refusal(method: str, url: str, exc: urllib.error.HTTPError) -> FeedError:
    raw = exc.read()
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace")[:200] or exc.reason
    hint = ""
    if exc.code == 401:
        hint = f" (the token is in the run dir's {FEED_FILE}, or set ${TOKEN_ENV})"
    return FeedError(f"{method} {url}: HTTP {exc.code}: {message}{hint}")
