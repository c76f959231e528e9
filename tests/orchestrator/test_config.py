from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import Config, load_config, parse_overrides
from orchestrator.errors import ConfigError
from policies.serve.backends.vllm_launch import vllm_command, vllm_env

CONFIGS = sorted(Path("configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.trainer.max_steps >= 1


def test_precedence_defaults_file_cli(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[trainer]\nmax_steps = 7\nlr = 0.01\n")
    cfg = load_config(f, parse_overrides(["--trainer.max_steps", "2"]))
    assert cfg.trainer.max_steps == 2  # CLI beats file
    assert cfg.trainer.lr == 0.01  # file beats default
    assert cfg.scheduler.group_size == 4  # default


def test_override_values_are_read_as_toml() -> None:
    got = parse_overrides(["--a.b", "2", "--c=true", "--d", "hello", "--e", "[1, 2]"])
    assert got == {"a.b": 2, "c": True, "d": "hello", "e": [1, 2]}


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[trainer]\nmax_stepz = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: trainer\.max_stepz: unknown key"):
        load_config(f)


def test_bad_value_on_command_line_names_key_and_source() -> None:
    with pytest.raises(ConfigError, match=r"command line: sampling\.top_p: .*less than or equal"):
        load_config(Path("configs/demo.toml"), parse_overrides(["--sampling.top_p", "2"]))


def test_a_json_table_on_the_command_line_is_refused_with_the_two_forms_that_work() -> None:
    """JSON is not TOML: the error says how a table is written there; both forms load."""
    demo = Path("configs/demo.toml")
    with pytest.raises(
        ConfigError,
        match=r"command line: environment\.args: Input should be a valid dictionary .*"
        r"a table is TOML \(\{ a = 1 \}\), or set one key at a time: --environment\.args\.a 1",
    ):
        load_config(demo, parse_overrides(["--environment.args", '{"num_tasks": 16}']))
    as_toml = load_config(demo, parse_overrides(["--environment.args", "{ num_tasks = 16 }"]))
    one_key = load_config(demo, parse_overrides(["--environment.args.num_tasks", "16"]))
    assert as_toml.environment.args == {"num_tasks": 16}
    assert one_key.environment.args["num_tasks"] == 16


@pytest.mark.parametrize("name", ["..", ".", "a..b", ".hidden", "x" * 129])
def test_a_run_name_that_is_not_one_board_segment_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"command line: run\.name: .*is not valid"):
        load_config(None, {"run.name": name})


def test_staleness_parameters_are_checked_at_load(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[staleness.correction]\ntype = "tis"\ncap = 0\n')
    with pytest.raises(ConfigError, match=r"staleness\.correction\.tis\.cap"):
        load_config(f)
    f.write_text('[staleness.correction]\ntype = "magic"\n')
    with pytest.raises(ConfigError, match=r"staleness\.correction"):
        load_config(f)


def test_staleness_loss_options_are_reachable_from_a_run_toml(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text(
        '[staleness]\nloss_agg = "dr_grpo"\ndr_grpo_tokens = 64\nnormalizer = "original"\n'
        '[staleness.correction]\ntype = "tis"\nlevel = "sequence"\ncap = 4.0\n'
    )
    st = load_config(f).staleness
    assert (st.loss_agg, st.dr_grpo_tokens, st.normalizer) == ("dr_grpo", 64, "original")
    assert (st.correction.type, getattr(st.correction, "level", None)) == ("tis", "sequence")
    f.write_text('[staleness]\nloss_agg = "dr_grpo"\n')
    with pytest.raises(ConfigError, match=r"staleness: .*dr_grpo_tokens: required"):
        load_config(f)
    f.write_text('[trainer]\nloss_agg = "seq_mean"\n')
    with pytest.raises(ConfigError, match=r"trainer: .*staleness\.loss_agg"):
        load_config(f)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    f = tmp_path / "broken.toml"
    f.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)


def test_cli_print_config_and_error_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--config", "configs/demo.toml", "--trainer.max_steps", "3", "--print-config"]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["trainer"]["max_steps"] == 3
    assert main(["--config", "configs/demo.toml", "--fleet.nope", "1"]) == 2
    assert "fleet.nope: unknown key" in capsys.readouterr().err


def test_a_correction_key_without_its_type_says_to_set_the_type() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(Path("configs/experiment-sweep.toml"), {"staleness.correction.cap": 2.0})
    assert (
        "command line: staleness.correction: the table does not say which kind it is: "
        "set staleness.correction.type" in str(err.value)
    )


def test_importing_config_does_not_import_torch() -> None:
    code = "import sys, orchestrator.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_external_trainer_needs_a_shared_board() -> None:
    with pytest.raises(ConfigError, match=r"board\.url must be set"):
        load_config(Path("configs/demo.toml"), parse_overrides(["--trainer.mode", "external"]))
    cfg = load_config(
        Path("configs/demo.toml"),
        parse_overrides(["--trainer.mode", "external", "--board.url", "/tmp/b"]),
    )
    assert cfg.board_url == "/tmp/b"


def test_minibatches_fit_the_batch_and_surrogates_keep_their_own_clip() -> None:
    cfg = load_config(None, {"scheduler.groups_per_batch": 3, "trainer.minibatches": 3})
    assert cfg.trainer.minibatches == 3
    with pytest.raises(ConfigError, match=r"trainer\.minibatches = 4: a batch has"):
        load_config(None, {"scheduler.groups_per_batch": 3, "trainer.minibatches": 4})
    gspo = {"staleness.correction.type": "gspo", "staleness.loss_agg": "seq_mean"}
    assert load_config(None, gspo).staleness.correction.type == "gspo"
    with pytest.raises(ConfigError, match=r"trainer\.dual_clip_c clips the PPO-clip term"):
        load_config(None, {**gspo, "trainer.dual_clip_c": 3.0})
    cispo = {"staleness.correction.type": "cispo", "trainer.clip_eps_high": 0.28}
    with pytest.raises(ConfigError, match=r"trainer\.clip_eps_high clips"):
        load_config(None, cispo)
    assert load_config(None, {"trainer.clip_eps_high": 0.28, "trainer.dual_clip_c": 3.0})


@pytest.mark.parametrize(
    "bench", ["codec", "engine", "sync", "sparsity", "router-replay", "scheduler", "async"]
)
def test_every_documented_bench_is_a_command(bench: str) -> None:
    """Each ``orchestrate bench NAME`` of the README and the CLI docstring answers ``--help``."""
    with pytest.raises(SystemExit) as done:
        main(["bench", bench, "--help"])
    assert done.value.code == 0


_MIXTURE = """
[[environments]]
name = "calc"
cls = "environments.calculator:Calculator"
weight = 2

[[environments]]
name = "guess"
cls = "environments.guess:Guess"
"""


def _mixture(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "mix.toml"
    f.write_text(text)
    return f


def test_a_mixture_parses_with_weights_and_per_environment_staleness(tmp_path: Path) -> None:
    text = _MIXTURE + 'staleness = { drop = { statistic = "mean", max_lag = 0 } }\n'
    text += '[staleness]\ndrop = { max_lag = 3 }\ncorrection = { type = "tis", cap = 3.0 }\n'
    cfg = load_config(_mixture(tmp_path, text))
    assert [(e.name, e.weight) for e in cfg.environments] == [("calc", 2.0), ("guess", 1.0)]
    own = cfg.environment_staleness()
    assert list(own) == ["guess"]  # calc has no table: the run's [staleness] decides it
    assert own["guess"].drop is not None
    assert own["guess"].drop.statistic == "mean"
    assert own["guess"].drop.max_lag == 0
    assert own["guess"].correction == cfg.staleness.correction  # keys not given: the run's


def test_an_empty_staleness_table_overrides_nothing(tmp_path: Path) -> None:
    text = _MIXTURE + "[environments.staleness]\n[staleness]\ndrop = { max_lag = 3 }\n"
    cfg = load_config(_mixture(tmp_path, text))
    assert cfg.environment_staleness() == {}  # an empty table overrides nothing
    text = _MIXTURE.replace("weight = 2\n", "weight = 2\nstaleness = { drop = {} }\n")
    with pytest.raises(ConfigError, match=r"environments\.0\.staleness\.drop\.max_lag"):
        load_config(_mixture(tmp_path, text))


def test_environment_and_environments_are_exclusive(tmp_path: Path) -> None:
    text = '[environment]\ncls = "environments.guess:Guess"\n' + _MIXTURE
    with pytest.raises(ConfigError, match=r"\[environment\] and \[\[environments\]\]"):
        load_config(_mixture(tmp_path, text))
    cfg = load_config(_mixture(tmp_path, _MIXTURE))
    assert Config.model_validate(cfg.model_dump(mode="json")) == cfg  # the run header's copy


def test_mixture_names_are_unique_and_weights_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="names must be unique, calc repeated"):
        load_config(_mixture(tmp_path, _MIXTURE.replace('"guess"', '"calc"')))
    with pytest.raises(ConfigError, match=r"environments\.0\.weight: Input should be greater"):
        load_config(_mixture(tmp_path, _MIXTURE.replace("weight = 2", "weight = 0")))
    with pytest.raises(ConfigError, match=r"environments\.1\.name"):
        load_config(_mixture(tmp_path, _MIXTURE.replace('"guess"', '"no spaces"')))


def test_only_drop_may_be_overridden_per_environment(tmp_path: Path) -> None:
    text = _MIXTURE + 'staleness = { loss_agg = "seq_mean" }\n'
    with pytest.raises(ConfigError, match=r"environments\.1\.staleness\.loss_agg: unknown key"):
        load_config(_mixture(tmp_path, text))


def test_a_vllm_island_returning_routing_starts_vllm_with_it_and_needs_a_gpu_build(
    tmp_path: Path,
) -> None:
    island = '[[fleet.islands]]\nkind = "vllm"\nrouted_experts = true\n'
    path = tmp_path / "run.toml"
    path.write_text(Path("configs/islands.toml").read_text() + "\n" + island)
    with pytest.raises(ConfigError, match=r"routed_experts = true needs a GPU build of vLLM"):
        load_config(path, {})
    path.write_text(path.read_text() + 'python = "/opt/vllm-gpu/bin/python"\n')
    spec = load_config(path, {}).fleet.islands[-1]
    assert spec.kind == "vllm"
    assert spec.routed_experts
    argv = vllm_command(
        Path(str(spec.python)), tmp_path, name="m", port=1, max_model_len=64, routed_experts=True
    )
    assert "--enable-return-routed-experts" in argv
    assert vllm_env(routed_experts=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "--enable-return-routed-experts" not in vllm_command(
        tmp_path, tmp_path, name="m", port=1, max_model_len=64
    )


def test_router_replay_needs_an_engine_of_the_fleet_that_returns_routing(tmp_path: Path) -> None:
    islands = "\n".join(f'[[fleet.islands]]\nkind = "{kind}"\n' for kind in ("vllm", "llamacpp"))
    path = tmp_path / "run.toml"
    path.write_text("[fleet]\nlocal_engines = 0\n\n" + islands)
    replay = parse_overrides(["--trainer.router_replay", "true"])
    with pytest.raises(ConfigError) as err:
        load_config(path, replay)
    assert "no engine of the fleet returns MoE routing" in str(err.value)
    assert "fleet.islands[0] (kind 'vllm') needs routed_experts = true" in str(err.value)
    assert "fleet.islands[1] (kind 'llamacpp') reports no routing" in str(err.value)
    assert not load_config(path, {}).trainer.router_replay  # without replay: any fleet
    with_reference = parse_overrides(
        ["--trainer.router_replay", "true", "--fleet.local_engines", "1"]
    )
    assert load_config(path, with_reference).trainer.router_replay


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nests deeper than 32 levels"),
        ("x = " + "{a = " * 50_000 + "1" + "}" * 50_000 + "\n", "nests deeper than 32 levels"),
        (
            "[environment.args]\n"
            + "".join(f"[environment.args{'.a' * i}]\n" for i in range(1, 60)),
            "environment.args.a.a",
        ),
    ],
    ids=["deep_arrays", "deep_inline_tables", "deep_tables_under_args"],
)
@pytest.mark.usefixtures("cli_logging")
def test_a_hostile_config_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, complaint: str
) -> None:
    path = tmp_path / "hostile.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=complaint):
        load_config(path)
    assert main(["--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().startswith(f"orchestrate: error: {path}")


def test_a_fifo_in_place_of_a_config_is_refused_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(path)


def test_dynamic_sampling_is_a_scheduler_table_and_checked(tmp_path: Path) -> None:
    """``[scheduler.dynamic_sampling]``: present is on, ``enabled = false`` off, a dotted override
    makes it; bad values and groups of one are refused naming the key."""
    assert load_config(None).scheduler.filters_groups is None
    f = tmp_path / "ds.toml"
    f.write_text("[scheduler.dynamic_sampling]\nmax_refills = 8\n")
    ds = load_config(f).scheduler.filters_groups
    assert ds is not None
    assert (ds.max_refills, ds.tolerance) == (8, None)
    off = load_config(f, parse_overrides(["--scheduler.dynamic_sampling.enabled", "false"]))
    assert off.scheduler.filters_groups is None
    on = load_config(None, parse_overrides(["--scheduler.dynamic_sampling.tolerance", "0.01"]))
    assert on.scheduler.filters_groups is not None
    assert Config.model_validate(on.model_dump(mode="json")) == on  # the run header's copy
    with pytest.raises(ConfigError, match=r"scheduler\.dynamic_sampling\.max_refills: .*greater"):
        load_config(f, parse_overrides(["--scheduler.dynamic_sampling.max_refills", "-1"]))
    with pytest.raises(ConfigError, match=r"scheduler\.dynamic_sampling\.tolerance: .*finite"):
        load_config(f, parse_overrides(["--scheduler.dynamic_sampling.tolerance", "inf"]))
    with pytest.raises(ConfigError, match=r"dynamic_sampling needs scheduler\.group_size >= 2"):
        load_config(f, parse_overrides(["--scheduler.group_size", "1"]))


def test_overlong_options_are_checked(tmp_path: Path) -> None:
    f = tmp_path / "o.toml"
    f.write_text('[staleness]\noverlong = "soft_penalty"\noverlong_buffer = 8\n')
    st = load_config(f).staleness
    assert (st.overlong, st.overlong_buffer, st.overlong_penalty_factor) == ("soft_penalty", 8, 1.0)
    assert load_config(None, {"staleness.overlong": "mask"}).staleness.overlong == "mask"
    with pytest.raises(ConfigError, match=r"command line: staleness\.overlong: Input should be"):
        load_config(None, {"staleness.overlong": "truncate"})
    with pytest.raises(ConfigError, match=r"staleness: .*overlong_buffer: required"):
        load_config(None, {"staleness.overlong": "soft_penalty"})
    with pytest.raises(ConfigError, match=r"overlong_buffer = 64 exceeds sampling.max_tokens = 48"):
        load_config(f, {"staleness.overlong_buffer": 64})
    with pytest.raises(ConfigError, match=r"staleness\.overlong_penalty_factor: .*greater"):
        load_config(f, {"staleness.overlong_penalty_factor": 0})
