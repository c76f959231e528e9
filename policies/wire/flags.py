"""Command-line flags from a pydantic model, and a model back to the argv that gives it.

A serving command's options (``orchestrate serve``, ``orchestrate sidecar``) are one pydantic
model: its fields are the flags, their defaults and validation are the model's, and the process
that starts the command builds the same model and turns it into argv (:func:`to_argv`), so a
setting has one definition, one default and one error message on both sides.

Conventions, per field: the flag is ``--`` and the field name with ``-`` for ``_`` unless
``FLAGS`` (a class attribute mapping field names to flags) names another; its help is the
field's docstring; a ``bool`` is a switch (``store_true``), a ``list[str]`` is repeated, a
``Literal`` lists its choices. A field marked ``secret`` (``json_schema_extra={"secret": ENV}``)
is never written into argv, where any process could read it: it travels in the environment
variable ``ENV`` (:func:`secret_env`), which is also its default when the flag is not given.

Guarantees: :func:`parse_flags` returns a valid model or exits through ``parser.error`` with
one line naming the flag and what is wrong with its value (argparse's own usage errors alike);
``parse_flags(to_argv(m))`` equals ``m`` for every model ``m`` without secrets.
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def flag_of(model: type[BaseModel], name: str) -> str:
    """The flag of ``model``'s field ``name``."""
    named: Mapping[str, str] = getattr(model, "FLAGS", {})
    return named.get(name) or "--" + name.replace("_", "-")


def _secret(model: type[BaseModel], name: str) -> str | None:
    extra = model.model_fields[name].json_schema_extra
    env = extra.get("secret") if isinstance(extra, dict) else None
    return env if isinstance(env, str) else None


def _bare(annotation: Any) -> Any:
    """``X`` of ``X | None`` (the annotation itself otherwise)."""
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """A flag per field of ``model`` (module docstring); defaults stay the model's."""
    for name, info in model.model_fields.items():
        kind = _bare(info.annotation)
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        secret = _secret(model, name)
        shown = f"${secret}" if secret else default
        kw["help"] = (info.description or "").rstrip(".") + (
            f" (default: {shown})" if shown not in (None, False, []) else ""
        )
        if kind is bool:
            kw["action"] = "store_true"
        elif get_origin(kind) is list:
            kw["action"] = "append"
        elif get_origin(kind) is Literal:
            kw["choices"] = [str(c) for c in get_args(kind)]
        kw["required"] = info.is_required()
        parser.add_argument(flag_of(model, name), **kw)


def parse_flags(parser: argparse.ArgumentParser, model: type[M], argv: list[str]) -> M:
    """The ``model`` ``argv`` gives (``parser`` holds :func:`add_flags`' flags, and maybe others
    the command reads itself); a bad value exits through ``parser.error`` naming its flag."""
    given = vars(parser.parse_args(argv))
    values = {k: v for k, v in given.items() if k in model.model_fields}
    for name in model.model_fields:
        env = _secret(model, name)
        if env and name not in values and os.environ.get(env):
            values[name] = os.environ[env]
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(part) for part in err["loc"]]
        if not loc or loc[0] not in model.model_fields:
            parser.error(str(err["msg"]).removeprefix("Value error, "))
        value = values.get(loc[0])
        shown = "" if _secret(model, loc[0]) else f"{value}: "
        parser.error(f"argument {flag_of(model, loc[0])}: {shown}{err['msg']}")


def to_argv(options: BaseModel) -> list[str]:
    """The flags that give ``options`` (every field set explicitly but the secrets)."""
    model = type(options)
    argv: list[str] = []
    for name in model.model_fields:
        if name not in options.model_fields_set or _secret(model, name):
            continue
        value, flag = getattr(options, name), flag_of(model, name)
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [f"{flag}={item}" for item in value]
        elif value is not None:
            argv.append(f"{flag}={value}")
    return argv


def secret_env(options: BaseModel) -> dict[str, str]:
    """The environment variables that carry ``options``' secrets to the command it starts."""
    model = type(options)
    out = {}
    for name in model.model_fields:
        env = _secret(model, name)
        value = getattr(options, name)
        if env and value is not None:
            out[env] = str(value)
    return out
