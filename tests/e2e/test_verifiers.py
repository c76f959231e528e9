"""verifiers 0.4 environments end to end: a mixture of four v1 environments installed as their own
packages (``examples/verifiers/``: ``vf_reverse``, single turn; ``vf_tools``, a tool server over
MCP; ``vf_broken``, a reward that raises; ``vf_hints``, its own ``vf.Env`` that gives a hint after
a wrong guess, so its episodes are multi-turn whatever the model says), loaded by ``kind =
"verifiers"`` with no sprawl code in them, each episode played by verifiers' own harness program
and train client, on the tiny model with a reference engine, for three trainer steps. The trainer's
recomputed log probs of the logged tokens match the engine's (``mismatch/logp_abs_mean``), so the
log holds the tokens the engine saw; every segment is stamped, and each verifiers episode's
``PolicySpan`` is its segments' stamps. The final version is then scored on fresh episodes
(:mod:`orchestrator.run.score`) through the same harness."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import anyio
import pytest
from transformers import AutoTokenizer

from orchestrator.config import load_config
from orchestrator.offline.resimulate import resimulate
from orchestrator.record.events import read_events
from orchestrator.record.frames import read_log
from orchestrator.run.score import score_policy
from tests.support.models import model_copy
from tests.support.processes import orchestrate_cmd

pytestmark = pytest.mark.slow
TEMPLATES = Path(__file__).resolve().parents[2] / "examples" / "chat_templates"

CONFIG = """
[run]
name = "vf"

[fleet]
local_engines = 1
device = "cpu"

[sampling]
temperature = 1.0
max_tokens = 16

[scheduler]
group_size = 2
groups_per_batch = 2
max_lag = 1
max_concurrent_episodes = 4

[timeouts]
episode_s = 300

[[environments]]
name = "reverse"
kind = "verifiers"
id = "vf_reverse"
renderer = { name = "qwen3", enable_thinking = false }
args = { agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }

[[environments]]
name = "tools"
kind = "verifiers"
id = "vf-tools"
max_turns = 3
renderer = { name = "qwen3", enable_thinking = false }
args = { agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }

[[environments]]
name = "broken"
kind = "verifiers"
id = "vf_broken"
renderer = { name = "qwen3", enable_thinking = false }
args = { agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }

[[environments]]
name = "hints"
kind = "verifiers"
id = "vf_hints"
renderer = { name = "qwen3", enable_thinking = false }
args = { agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }

[staleness]
drop = { statistic = "max", max_lag = 1 }

[staleness.correction]
type = "tis"
cap = 2.0

[trainer]
max_steps = 3
"""


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Qwen3-like template and Qwen3's tokenizer config (no unk token)."""
    out = model_copy(
        "tiny", tmp_path_factory.mktemp("qwen3") / "m", chat_template=TEMPLATES / "qwen3_like.jinja"
    )
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "unk_token": None}))
    return out


def test_verifiers_environments_train_under_the_loop(tmp_path: Path, qwen3_model: Path) -> None:
    config = tmp_path / "vf.toml"
    config.write_text(CONFIG)
    cmd = orchestrate_cmd(tmp_path, qwen3_model, config=config)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     3" in proc.stdout

    run_dir = tmp_path / "vf"
    records = read_log(run_dir / "trajectories")
    episodes = [r["episode"] for r in records if r["type"] == "episode"]
    assert {e["environment"] for e in episodes} == {"reverse", "tools", "broken", "hints"}
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model)
    scored = multi = 0
    for e in episodes:
        if e["stop_reason"] == "interrupted":  # in flight when the run ended
            continue
        segments = e["segments"]
        assert segments, e["error"]
        assert segments[0]["prompt_len"] == e["prompt_len"]
        for seg in segments:  # each call's tokens sit where it says, with their log probs
            start = seg["prompt_len"]
            assert e["token_ids"][start : start + len(seg["token_ids"])] == seg["token_ids"]
            assert len(seg["logprobs"]) == len(seg["token_ids"])
            assert seg["policy_version"]["start"] <= seg["policy_version"]["end"]
            assert seg["bounds"]["min"] is not None  # the group's lag bound rode every call
        for before, after in itertools.pairwise(segments):  # what the user said, bridged
            between = e["token_ids"][
                before["prompt_len"] + len(before["token_ids"]) : after["prompt_len"]
            ]
            assert "No. Hint: it starts with" in tokenizer.decode(between)
            multi += 1
        facts = e["metadata"]["verifiers"]
        assert facts["policy"] == {
            "start": min(s["policy_version"]["start"] for s in segments),
            "end": max(s["policy_version"]["end"] for s in segments),
        }
        if e["error"] is not None:  # data, never a crash; and never a call sprawl refused
            assert e["stop_reason"] == "env_error", e["error"]
            assert e["error"]["where"] == "environment"
            assert "re-tokenized" not in e["error"]["message"]
            if e["environment"] == "broken":
                assert e["error"]["message"].startswith("reward: ")
                assert "KeyError" in e["error"]["message"]
            continue
        assert e["environment"] != "broken" or e["reward"] == 1.0  # it said "yes"
        names = {"reverse": {"exact", "overlap"}, "tools": {"correct"}, "hints": {"guessed"}}
        assert set(e["rewards"]) == names.get(e["environment"], {"echoed"})
        scored += 1
    assert scored > 0
    assert multi > 0, "no multi-turn episode reached the log"

    batches = [r for r in records if r["type"] == "batch"]
    assert [b["produced_version"] for b in batches] == [1, 2, 3]
    for b in batches:  # the staleness correction ran on the logged log probs
        assert b["metrics"]["is/kept_tokens"] > 0
        assert b["metrics"]["mismatch/logp_abs_mean"] < 0.02
    events = read_events(run_dir)
    again = resimulate(events, trajectories=run_dir / "trajectories")
    assert again.ok, again.mismatches

    # the final version scored as the lag experiment scores it: verifiers' own harness again,
    # its server beside; the broken reward's episodes fail and are counted, not lost
    cfg = load_config(config, {"run.root": str(tmp_path), "model.path": str(qwen3_model)})
    score = anyio.run(score_policy, cfg, 8)
    assert score.version == 3
    assert len(score.rewards) == 8
    assert score.failed >= 1  # two of the eight are "broken"'s, which fail but for "yes"
