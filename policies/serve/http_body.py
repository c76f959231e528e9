"""Reading what an HTTP client sent, safely: bearer tokens and JSON bodies (no torch).

Guarantees: :func:`bearer_matches` compares in constant time and answers False (never raises)
for any header, non-ASCII bytes included; :func:`read_json` returns the parsed body or raises
:class:`BadRequest` naming what is wrong, for a body that is not UTF-8 (or names an unknown
charset) or not JSON, nests deeper than Python's recursion limit, holds an integer of more than
:data:`MAX_INT_DIGITS` digits, or holds a string (or key) with a lone surrogate (``"\\ud800"``:
valid JSON, but no Unicode text, which tokenizers and headers cannot encode). The lane and the
orchestrator's admin API answer it as a 400 JSON error, so a hostile body never becomes a
plain-text 500. The body is read on the event loop and parsed in a worker thread: parsing a
megabyte takes a tenth of a second or more, which the loop's other requests need not wait for.

Not covered: the body's size (aiohttp's ``client_max_size``: the lane's ``--max-body-bytes``,
:mod:`policies.serve.server`) and its shape (each route's pydantic model).
"""

from __future__ import annotations

import hmac
import json
import re

import anyio
from aiohttp import web

from policies.errors import BadRequest

MAX_INT_DIGITS = 64
"""Digits an integer in a body may have (a token id, a seed or a version needs at most 20)."""
_MAY_HOLD_SURROGATE = re.compile("\\\\u[dD][89a-fA-F]|[\ud800-\udfff]")
"""JSON's escape of a surrogate, or one in the text itself (a charset such as
``raw_unicode_escape`` decodes to it): a body without either holds no lone surrogate."""


def bearer_matches(header: str, token: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <token>``, in constant time."""
    # aiohttp hands undecodable header bytes over as surrogate escapes: compare the raw bytes
    given = header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer has {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


async def read_json(request: web.Request) -> object:
    """The request's JSON body; :class:`BadRequest` if it is not one a route can use."""
    body = await request.read()
    return await anyio.to_thread.run_sync(parse_json, body, request.charset or "utf-8")


def parse_json(body: bytes, charset: str = "utf-8") -> object:
    """``body`` parsed (see :func:`read_json`); :class:`BadRequest` naming what is wrong."""
    try:
        text = body.decode(charset)
        payload: object = json.loads(text, parse_int=_int)
    except RecursionError:
        raise BadRequest("body is not JSON a server can read: nested too deeply") from None
    except (ValueError, LookupError) as exc:  # not UTF-8 / unknown charset / not JSON / long int
        raise BadRequest(f"body is not JSON: {exc}") from None
    if _MAY_HOLD_SURROGATE.search(text) is None:
        return payload
    where = _lone_surrogate(payload)
    if where is not None:
        raise BadRequest(
            f"{where or 'body'}: a string holds a lone surrogate (not valid Unicode)", where or None
        )
    return payload


def _lone_surrogate(payload: object) -> str | None:
    """The dotted path of the first string (or key) that is not encodable Unicode; None if none
    ("" for the body itself). Iterative: a body as deep as JSON allows cannot overflow it."""
    stack: list[tuple[tuple[str | int, ...], object]] = [((), payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return ".".join(map(str, path))
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(str(key)):
                    return ".".join(map(str, path)) or "body"
                stack.append(((*path, str(key)), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
