"""The model a run starts from, and the run directory it writes into: what is refused, and how."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import ConfigError
from orchestrator.models import ensure_model
from orchestrator.run.run_dir import prepare_run_dir

DEMO = Path("configs/demo.toml")


def test_warm_start_needs_a_model_to_build() -> None:
    with pytest.raises(ConfigError, match=r"model\.warm_start needs model\.init"):
        load_config(DEMO, {"model.init": None})


def test_warm_start_refuses_a_run_without_the_calculator(tmp_path: Path) -> None:
    cfg = load_config(
        Path("configs/guess.toml"),
        parse_overrides(["--model.path", str(tmp_path / "m"), "--model.warm_start.steps", "5"]),
    )
    with pytest.raises(ConfigError, match=r"model\.warm_start: .* no environment of this run"):
        ensure_model(cfg)
    assert not (tmp_path / "m").exists()


@pytest.mark.usefixtures("cli_logging")
def test_an_earlier_run_is_kept_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(DEMO, {"run.root": str(tmp_path)})
    run_dir = prepare_run_dir(cfg)
    (run_dir / "trajectories").mkdir()
    with pytest.raises(ConfigError, match=r"run\.name: .*demo holds an earlier run \(started "):
        prepare_run_dir(cfg)
    assert (run_dir / "trajectories").is_dir()
    # the command line says the same in one line, exit 2, no traceback
    assert main(["--config", str(DEMO), "--run.root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--run.overwrite true" in err
    assert "--run.resume true" in err
    assert "Traceback" not in err
    replaced = prepare_run_dir(
        load_config(DEMO, {"run.root": str(tmp_path), "run.overwrite": True})
    )
    assert replaced == run_dir
    assert not (run_dir / "trajectories").exists()


def test_secrets_never_reach_the_files_a_run_writes(tmp_path: Path) -> None:
    """Tokens set in the config are masked in config.json and the trajectory log's run.json,
    which are readable by their owner only; the config still hands the real values to use."""
    from orchestrator.record.trajlog import TrajectoryLog
    from orchestrator.run.wiring import secret

    overrides = {
        "run.root": str(tmp_path),
        "admin.token": "adm1n-s3cret",
        "trainer.feed.token": "f33d-s3cret",
        "fleet.endpoints": [{"url": "http://127.0.0.1:9", "token": "3ndp0int-s3cret"}],
    }
    cfg = load_config(DEMO, overrides)
    run_dir = prepare_run_dir(cfg)
    log = TrajectoryLog(
        run_dir / "trajectories", run=cfg.run.name, config=cfg.model_dump(mode="json")
    )
    log.close()
    for path in (run_dir / "config.json", run_dir / "trajectories" / "run.json"):
        text = path.read_text()
        assert "s3cret" not in text, path
        assert "**********" in text
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert secret(cfg.admin.token) == "adm1n-s3cret"
    assert secret(cfg.trainer.feed.token) == "f33d-s3cret"
    assert [e.token for e in cfg.fleet.endpoint_refs()] == ["3ndp0int-s3cret"]
