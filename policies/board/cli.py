"""``orchestrate versions`` and ``orchestrate materialize``: look at a board from the shell.

    orchestrate versions --board URL [--run NAME] [--json]
    orchestrate materialize --board URL [--run NAME] --version N --out DIR
    orchestrate materialize --board URL [--run NAME] --version N --format gguf --out FILE.gguf

``versions`` lists every published version: version, kind (anchor | delta), base, bytes of its
primary representation, density (changed fraction against the previous version, when a delta
from it is stored), the number of patches into it, the number of ranks that published it (1
unless a :class:`~policies.board.ShardedPublisher` sharded it) and the publish time (UTC).
``materialize``
writes an HF checkpoint directory of one version (bit-identical to an anchor of it), or with
``--format gguf`` one GGUF file for llama.cpp (:mod:`policies.board.gguf`; F32 matrices unless
``--gguf-dtype bf16``). Board
credentials come from the environment (e.g. ``AWS_*``), never from the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from policies.board import Board


def _board(args: argparse.Namespace) -> Board:
    return Board(args.board, args.run)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--board", required=True, help="board URL (fsspec) or path")
    parser.add_argument("--run", default="demo", help="run name on the board")
    return parser


def versions(argv: list[str]) -> int:
    parser = _parser("orchestrate versions")
    parser.add_argument("--json", action="store_true", help="one JSON list")
    args = parser.parse_args(argv)
    board = _board(args)
    rows = [
        {
            "version": m.version,
            "kind": m.kind,
            "base": m.base,
            "bytes": m.bytes,
            "density": m.density,
            "patches": len(m.patches),
            "ranks": len(m.shards) or 1,
            "time": m.created_at,
        }
        for m in (board.manifest(v) for v in board.versions())
    ]
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    sys.stdout.write(
        f"{'version':>8}  {'kind':<6}  {'base':>6}  {'bytes':>14}  {'density':>8}  "
        f"{'patches':>7}  {'ranks':>5}  time (UTC)\n"
    )
    for r in rows:
        density = "-" if r["density"] is None else f"{r['density']:.3%}"
        base = "-" if r["base"] is None else str(r["base"])
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(str(r["time"]))))
        sys.stdout.write(
            f"{r['version']:>8}  {r['kind']:<6}  {base:>6}  {r['bytes']:>14,}  {density:>8}  "
            f"{r['patches']:>7}  {r['ranks']:>5}  {stamp}\n"
        )
    return 0


def materialize(argv: list[str]) -> int:
    parser = _parser("orchestrate materialize")
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="a directory (hf) or file (gguf)")
    parser.add_argument("--format", choices=["hf", "gguf"], default="hf")
    parser.add_argument(
        "--gguf-dtype", choices=["f32", "bf16"], default="f32", help="GGUF matrix dtype"
    )
    args = parser.parse_args(argv)
    if args.format == "gguf":
        from policies.board.gguf import materialize_gguf

        out = materialize_gguf(_board(args), args.version, args.out, matrix_dtype=args.gguf_dtype)
    else:
        out = _board(args).materialize(args.version, args.out)
    sys.stdout.write(f"{out}\n")
    return 0
