"""Loading the config tree: defaults, then a TOML file, then dotted command-line overrides.

Precedence is defaults < TOML file < command line. A command-line override mirrors the field
path: ``--trainer.max_steps 2`` sets ``[trainer] max_steps = 2``; its value is read as a TOML
value when it parses as one (``2``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``) and as a plain string
otherwise. Any unknown key or bad value fails before anything starts, with a :class:`ConfigError`
naming the key and where it came from (the file, or the command line).

Hostile files are bounded: the file must be a regular file of at most :data:`MAX_FILE_BYTES`
(a FIFO is refused, never waited on), and a value may nest arrays and tables at most
:data:`MAX_DEPTH` deep (deeper is refused naming the key, before it can exhaust the parser's
recursion or a later serialization).
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.config.tree import Config
from orchestrator.errors import ConfigError

MAX_FILE_BYTES = 16 << 20
"""The largest config file read."""
MAX_DEPTH = 32
"""How deep arrays and tables may nest in a config (sections included)."""


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--a.b", "1", "--c=x"]`` into ``{"a.b": 1, "c": "x"}`` (values read as TOML)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key VALUE"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} (command line): missing value")
            value = args[i + 1]
            i += 1
        out[key] = _toml_value(value)
        i += 1
    return out


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"a command-line value nests deeper than {MAX_DEPTH} levels") from None


def _read(path: Path) -> dict[str, Any]:
    """The TOML of the regular file ``path`` (module docstring's bounds)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        what = "Is a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ConfigError(f"{path}: {what}")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: {info.st_size} bytes, more than a config may hold")
        raw = f.read(MAX_FILE_BYTES + 1)
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nests deeper than {MAX_DEPTH} levels") from None


def _check_depth(value: Any, key: str, source: str, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ConfigError(f"{source}: {key}: nested more than {MAX_DEPTH} levels deep")
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, v in items:
        if isinstance(v, dict | list):
            _check_depth(v, f"{key}.{k}" if key else str(k), source, depth + 1)


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Load ``path`` (TOML), apply dotted ``overrides``; raise :class:`ConfigError` on a problem."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = _read(path)
        _check_depth(data, "", source)
    from_cli: set[str] = set()
    for dotted, value in (overrides or {}).items():
        _check_depth({dotted: value}, "", "command line")
        _set_dotted(data, dotted, value)
        from_cli.add(dotted)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source, from_cli)) from None


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted} (command line): {part} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(exc: ValidationError, source: str, from_cli: set[str]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        where = (  # a key set on the command line, or a table one of its keys was set in
            "command line"
            if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in from_cli)
            else source
        )
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "union_tag_not_found":  # a table of several kinds without its kind
            name = err["ctx"]["discriminator"].strip("'")
            msg = f"the table does not say which kind it is: set {key}.{name}"
        got = "" if err["type"] == "extra_forbidden" else f" (got {err['input']!r})"
        if where == "command line" and err["type"] == "dict_type":
            got += (
                f"; on the command line a table is TOML ({{ a = 1 }}), or set one key at a "
                f"time: --{key}.a 1"
            )
        lines.append(f"{where}: {key or '<root>'}: {msg}{got}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
