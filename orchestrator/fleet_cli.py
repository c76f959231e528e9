"""``orchestrate fleet add|remove|list --orchestrator URL|RUN_DIR``: the admin API's client.

The admin API always requires its bearer token. The token sent is ``--token``, else
``$SPRAWL_ADMIN_TOKEN``, else the one in the run directory's ``admin.json`` (when
``--orchestrator`` names a run directory, which also gives the URL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from rich.console import Console
from rich.table import Table

from orchestrator.errors import SprawlError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate fleet", description="Change a running orchestrator's fleet."
    )
    parser.add_argument("action", choices=["list", "add", "remove"])
    parser.add_argument(
        "--orchestrator",
        required=True,
        help="admin API URL, or a run directory (its admin.json names the URL and token)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("SPRAWL_ADMIN_TOKEN"),
        help="admin bearer token (default: $SPRAWL_ADMIN_TOKEN, else the run dir's admin.json)",
    )
    parser.add_argument("--id", help="endpoint id (add, remove)")
    parser.add_argument("--url", help="endpoint base URL (add)")
    parser.add_argument("--endpoint-token", help="the endpoint's bearer token (add)")
    parser.add_argument("--weight", type=float, default=1.0, help="relative capacity (add)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.action in ("add", "remove") and not args.id:
        parser.error(f"fleet {args.action} needs --id")
    if args.action == "add" and not args.url:
        parser.error("fleet add needs --url")
    result = anyio.run(_call, args)
    if args.json or args.action != "list":
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        _table(result["endpoints"])
    return 0


async def _call(args: argparse.Namespace) -> dict[str, Any]:
    address = admin_address(args.orchestrator)
    base = address.url
    token = args.token or address.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if args.action == "list":
        method, url, body = "GET", f"{base}/v1/fleet", None
    elif args.action == "add":
        method, url = "POST", f"{base}/v1/fleet"
        body = {"id": args.id, "url": args.url, "token": args.endpoint_token, "weight": args.weight}
    else:
        method, url, body = "DELETE", f"{base}/v1/fleet/{args.id}", None
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method, url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=10)
            ) as r,
        ):
            payload: dict[str, Any] = await r.json(content_type=None)
            if r.status >= 400:
                hint = ""
                if r.status == 401:
                    hint = (
                        " (pass --token or set $SPRAWL_ADMIN_TOKEN, or give --orchestrator the "
                        "run directory, whose admin.json holds the token)"
                    )
                raise SprawlError(
                    f"{method} {url}: HTTP {r.status}: "
                    f"{payload.get('error', {}).get('message', payload)}{hint}"
                )
            return payload
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise SprawlError(f"cannot reach the orchestrator at {base}: {exc}") from exc


@dataclass(frozen=True)
class AdminAddress:
    """Where the admin API listens, and its token when the run directory's file gave it."""

    url: str
    token: str | None = None


def admin_address(target: str) -> AdminAddress:
    """The admin API from a URL, or from a run directory's ``admin.json``."""
    if target.startswith(("http://", "https://")):
        return AdminAddress(target.rstrip("/"))
    path = Path(target) / "admin.json"
    try:
        written = json.loads(path.read_text())
        token = written.get("token")
        return AdminAddress(
            str(written["url"]).rstrip("/"), str(token) if token is not None else None
        )
    except (OSError, KeyError, ValueError, AttributeError) as exc:
        msg = f"--orchestrator {target}: not a URL, and {path} is unreadable: {exc}"
        raise SprawlError(msg) from None


def _table(endpoints: list[dict[str, Any]]) -> None:
    table = Table("id", "url", "version", "healthy", "outstanding", "limit", "breaker", "served")
    for e in endpoints:
        served = ", ".join(f"v{v}×{n}" for v, n in e["served"].items())
        table.add_row(
            e["id"],
            e["url"],
            str(e["applied_version"]),
            str(e["healthy"]),
            str(e["outstanding"]),
            str(e["limit"]),
            "open" if e["breaker_open"] else "closed",
            served,
        )
    Console().print(table)
