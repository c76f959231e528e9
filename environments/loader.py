"""Load an environment: a class by import path (``module:Class``), its arguments validated by
its ``Config``; or a verifiers 0.4 environment by its taskset's id
(:mod:`environments.verifiers_adapter`)."""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import ValidationError

from environments.base import Environment
from environments.errors import EnvironmentLoadError


def load_environment(
    path: str,
    args: dict[str, Any],
    *,
    key: str = "environment",
    kind: Literal["class", "verifiers"] = "class",
    renderer: dict[str, Any] | None = None,
) -> Environment:
    """Import ``path`` and build it with ``args`` validated by its ``Config`` model; errors name
    the config table ``key`` (``environments[0]`` in a mixture). ``kind = "verifiers"``:
    ``path`` is a verifiers taskset's id, ``args`` its environment's ``[env]`` table and
    ``renderer`` its train client's renderer config."""
    if kind == "verifiers":
        from environments.verifiers_adapter import load_verifiers_environment

        return load_verifiers_environment(path, args, renderer=renderer, key=key)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(f"{key}.cls: expected 'module:Class', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(f"{key}.cls: cannot import {module_name!r}: {exc}") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(f"{key}.cls: {path!r} is not an Environment subclass")
    try:
        config = cls.Config.model_validate(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise EnvironmentLoadError(f"{key}.args.{field}: {err['msg']}") from None
    try:
        return cls(config)
    except EnvironmentLoadError:
        raise
    except Exception as exc:  # user code at the boundary: one error type, naming the key
        raise EnvironmentLoadError(
            f"{key}.cls: {path} could not start: {type(exc).__name__}: {exc}"
        ) from exc
