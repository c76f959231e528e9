"""``orchestrate fleet …``: the admin API's client, for a run going on.

- ``list|add|remove --orchestrator URL|RUN_DIR``: the pool's endpoints;
- ``up|scale N|down --orchestrator URL|RUN_DIR`` (or ``--config X``, whose run directory it
  is): the run's Ray islands (``[fleet.ray]``, :mod:`orchestrator.fleet`). ``up`` asks for
  ``fleet.ray.islands`` of the config (or ``--islands``), ``down`` for none; removal drains
  first. With ``--wait`` the command returns once the islands are as asked (or fails naming
  those that are not, after ``--wait-s``).

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

ISLAND_ACTIONS = ("up", "scale", "down")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate fleet", description="Change a running orchestrator's fleet."
    )
    parser.add_argument("action", choices=["list", "add", "remove", *ISLAND_ACTIONS])
    parser.add_argument("islands", nargs="?", type=int, help="the number of islands (scale)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--orchestrator",
        help="admin API URL, or a run directory (its admin.json names the URL and token)",
    )
    where.add_argument("--config", type=Path, help="the run's config (its run directory)")
    parser.add_argument(
        "--token",
        default=os.environ.get("SPRAWL_ADMIN_TOKEN"),
        help="admin bearer token (default: $SPRAWL_ADMIN_TOKEN, else the run dir's admin.json)",
    )
    parser.add_argument("--id", help="endpoint id (add, remove)")
    parser.add_argument("--url", help="endpoint base URL (add)")
    parser.add_argument("--endpoint-token", help="the endpoint's bearer token (add)")
    parser.add_argument("--weight", type=float, default=1.0, help="relative capacity (add)")
    parser.add_argument("--wait", action="store_true", help="up/scale/down: until done")
    parser.add_argument("--wait-s", type=float, default=600.0, help="how long --wait waits")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args, rest = parser.parse_known_args(argv)
    if rest and args.config is None:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.action in ("add", "remove") and not args.id:
        parser.error(f"fleet {args.action} needs --id")
    if args.action == "add" and not args.url:
        parser.error("fleet add needs --url")
    if args.action == "scale" and args.islands is None:
        parser.error("fleet scale needs the number of islands: orchestrate fleet scale N …")
    if args.config is not None:
        from orchestrator.config import load_config, parse_overrides

        cfg = load_config(args.config, parse_overrides(rest))
        args.orchestrator = str(cfg.run_dir)
        if args.action == "up" and args.islands is None:
            if cfg.fleet.ray is None:
                raise SprawlError(f"{args.config}: fleet up needs a [fleet.ray] section")
            args.islands = cfg.fleet.ray.islands
    if args.action == "up" and args.islands is None:
        parser.error("fleet up --orchestrator needs the number of islands: fleet up N …")
    if args.action == "down":
        args.islands = 0
    result = anyio.run(_call, args)
    if args.json or args.action != "list":
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        _table(result["endpoints"])
    return 0


async def _call(args: argparse.Namespace) -> dict[str, Any]:
    address = admin_address(args.orchestrator)
    admin = _Admin(address.url, args.token or address.token)
    if args.action == "list":
        return await admin.request("GET", "/v1/fleet")
    if args.action == "add":
        body = {"id": args.id, "url": args.url, "token": args.endpoint_token, "weight": args.weight}
        return await admin.request("POST", "/v1/fleet", body)
    if args.action == "remove":
        return await admin.request("DELETE", f"/v1/fleet/{args.id}")
    asked = await admin.request("POST", "/v1/fleet/ray", {"islands": args.islands})
    if not args.wait:
        return asked
    with anyio.move_on_after(args.wait_s):
        while True:
            state = await admin.request("GET", "/v1/fleet/ray")
            islands = state["islands"]
            if len(islands) == args.islands and all(i["state"] == "serving" for i in islands):
                return state
            await anyio.sleep(1.0)
    pending = [f"{i['id']} ({i['state']})" for i in islands if i["state"] != "serving"]
    raise SprawlError(
        f"fleet {args.action}: after {args.wait_s}s (--wait-s) the run has {len(islands)} "
        f"islands, not {args.islands}; not serving: {', '.join(pending) or 'none'}"
    )


@dataclass(frozen=True)
class _Admin:
    url: str
    token: str | None

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        url = f"{self.url}{path}"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
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
                            " (pass --token or set $SPRAWL_ADMIN_TOKEN, or give --orchestrator "
                            "the run directory, whose admin.json holds the token)"
                        )
                    raise SprawlError(
                        f"{method} {url}: HTTP {r.status}: "
                        f"{payload.get('error', {}).get('message', payload)}{hint}"
                    )
                return payload
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SprawlError(f"cannot reach the orchestrator at {self.url}: {exc}") from exc


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
