"""The serving commands' options: flags generated from one model, argv generated back from it,
one error line naming the flag, and secrets kept out of argv."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from policies.serve.options import ServeOptions, SidecarOptions
from policies.wire.flags import add_flags, parse_flags, secret_env, to_argv


def _parse(model: type[ServeOptions] | type[SidecarOptions], argv: list[str]) -> object:
    parser = argparse.ArgumentParser(prog=f"orchestrate {model.COMMAND}")
    add_flags(parser, model)
    return parse_flags(parser, model, argv)


def _error(
    capsys: pytest.CaptureFixture[str],
    model: type[ServeOptions] | type[SidecarOptions],
    argv: list[str],
) -> str:
    with pytest.raises(SystemExit) as stop:
        _parse(model, argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


def test_argv_built_from_options_parses_back_to_them(tmp_path: Path) -> None:
    sidecar = SidecarOptions(
        engine_kind="llamacpp",
        board="s3://b/p",
        run="r1",
        port=0,
        poll_interval=0.5,
        llama_arg=["--threads", "-1"],
        llama_restart=True,
        parent_stdin=True,
        log_format="json",
        max_connections=64,
        materialize_dir=tmp_path,
    )
    assert _parse(SidecarOptions, to_argv(sidecar)) == sidecar
    serve = ServeOptions(board=str(tmp_path), port=0, device="cpu", header_timeout_s=2.5)
    assert _parse(ServeOptions, to_argv(serve)) == serve
    assert "--header-timeout=2.5" in to_argv(serve)


def test_defaults_are_the_models(tmp_path: Path) -> None:
    got = _parse(SidecarOptions, ["--engine-kind", "vllm", "--engine-url", "u", "--board", "b"])
    assert got == SidecarOptions(engine_kind="vllm", engine_url="u", board="b")
    assert isinstance(got, SidecarOptions)
    assert (got.port, got.poll_interval, got.max_connections) == (8100, 1.0, 512)
    assert _parse(ServeOptions, ["--model", str(tmp_path)]) == ServeOptions(model=tmp_path)


@pytest.mark.parametrize(
    ("model", "argv", "line"),
    [
        (ServeOptions, ["--board", "b", "--port", "70000"], "argument --port: 70000: Input should"),
        (ServeOptions, ["--board", "b", "--poll-interval", "nan"], "argument --poll-interval"),
        (ServeOptions, [], "give exactly one of --model and --board"),
        (ServeOptions, ["--model", "m", "--board", "b"], "give exactly one of --model and --board"),
        (ServeOptions, ["--board", "b", "--tls-cert", "c"], "--tls-cert and --tls-key go together"),
        (ServeOptions, ["--board", "b", "--max-connections", "0"], "argument --max-connections"),
        (SidecarOptions, ["--engine-kind", "vllm", "--board", "b"], "needs --engine-url"),
        (
            SidecarOptions,
            ["--engine-kind", "llamacpp", "--board", "b", "--engine-url", "u"],
            "llamacpp starts its own engine; no --engine-url",
        ),
        (
            SidecarOptions,
            ["--engine-kind", "openai", "--board", "b", "--engine-url", "u"],
            "--engine-kind openai needs --version",
        ),
        (SidecarOptions, ["--board", "b"], "the following arguments are required: --engine-kind"),
        (SidecarOptions, ["--engine-kind", "tgi", "--board", "b"], "invalid choice: 'tgi'"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_flag(
    capsys: pytest.CaptureFixture[str],
    model: type[ServeOptions] | type[SidecarOptions],
    argv: list[str],
    line: str,
) -> None:
    got = _error(capsys, model, argv)
    assert got.startswith(f"orchestrate {model.COMMAND}: error: "), got
    assert line in got


def test_secrets_travel_in_the_environment_never_in_argv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = SidecarOptions(
        engine_kind="vllm", engine_url="u", board="b", token="t0k3n", engine_api_key="k3y"
    )
    assert not any("t0k3n" in a or "k3y" in a for a in to_argv(options))
    env = secret_env(options)
    assert env == {"SPRAWL_TOKEN": "t0k3n", "SPRAWL_ENGINE_API_KEY": "k3y"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _parse(SidecarOptions, to_argv(options)) == options
