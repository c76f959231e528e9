"""HTTP/1.1 by hand: requests with bytes no HTTP client would send (for hostile-input tests)."""

from __future__ import annotations

import anyio


async def raw_http(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is (bytes no HTTP client would send) and read the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as sock:
        await sock.send(request)
        data = b""
        with anyio.fail_after(30):
            while True:
                try:
                    data += await sock.receive()
                except anyio.EndOfStream:
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def raw_post(path: str, body: bytes, auth: bytes = b"Bearer tok") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        + b"Authorization: "
        + auth
        + b"\r\n\r\n"
        + body
    )
