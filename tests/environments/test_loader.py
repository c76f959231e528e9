"""Loading an environment from the config: every failure names the config table it came from."""

from __future__ import annotations

import pytest

from environments.calculator import Calculator
from environments.errors import EnvironmentLoadError
from environments.loader import load_environment


def test_loads_and_validates_args() -> None:
    env = load_environment("environments.calculator:Calculator", {"num_tasks": 3})
    assert isinstance(env, Calculator)
    assert len(list(env.tasks())) == 3


@pytest.mark.parametrize(
    ("path", "args", "message"),
    [
        ("environments.calculator", {}, r"environment\.cls: expected 'module:Class'"),
        ("no_such_module:X", {}, r"environment\.cls: cannot import 'no_such_module'"),
        ("environments.calculator:json", {}, r"environment\.cls: .* is not an Environment"),
        ("environments.calculator:Calculator", {"num_tasks": 0}, r"environment\.args\.num_tasks"),
    ],
)
def test_errors_name_the_key(path: str, args: dict[str, object], message: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=message):
        load_environment(path, args)


def test_a_mixtures_entry_is_named_by_its_index() -> None:
    with pytest.raises(EnvironmentLoadError, match=r"^environments\[1\]\.args\.num_tasks"):
        load_environment(
            "environments.calculator:Calculator", {"num_tasks": -1}, key="environments[1]"
        )
