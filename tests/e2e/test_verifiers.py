"""verifiers environments end to end: a mixture of a ``SingleTurnEnv``, a ``ToolEnv`` and a
``MultiTurnEnv`` that answers with user turns (``tests/support/vf_reverse.py``, ``vf_tools.py``,
``vf_feedback.py``), loaded by ``kind = "verifiers"``, on the tiny model with two reference
engines, for two trainer steps. The trainer's recomputed log probs of the logged tokens match
the engines' (``mismatch/logp_abs_mean``), so the log holds the tokens the engines saw."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from orchestrator.offline.resimulate import resimulate
from orchestrator.record.events import read_events
from orchestrator.record.frames import read_log
from tests.support import vf_feedback, vf_reverse, vf_tools
from tests.support.processes import orchestrate_cmd

pytestmark = pytest.mark.slow

CONFIG = """
[run]
name = "vf"

[fleet]
local_engines = 2
device = "cpu"

[sampling]
temperature = 1.0
max_tokens = 24

[scheduler]
group_size = 2
groups_per_batch = 2
max_lag = 1

[[environments]]
name = "reverse"
kind = "verifiers"
id = "tests.support.vf_reverse"
args = { num_tasks = 4 }

[[environments]]
name = "tools"
kind = "verifiers"
id = "tests.support.vf-tools"
max_turns = 3

[[environments]]
name = "hints"
kind = "verifiers"
id = "tests.support.vf_feedback"
max_turns = 3

[staleness]
drop = { statistic = "max", max_lag = 1 }

[staleness.correction]
type = "tis"
cap = 2.0

[trainer]
max_steps = 2
"""


def test_verifiers_environments_run_under_the_loop(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "vf.toml"
    config.write_text(CONFIG)
    cmd = orchestrate_cmd(tmp_path, tiny_model_dir, config=config)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps:     2" in proc.stdout

    run_dir = tmp_path / "vf"
    records = read_log(run_dir / "trajectories")
    episodes = [r["episode"] for r in records if r["type"] == "episode"]
    assert {e["environment"] for e in episodes} == {"reverse", "tools", "hints"}
    answers = {
        "reverse": {
            str(i): r["answer"] for i, r in enumerate(vf_reverse.load_environment().dataset)
        },
        "tools": {str(i): r["answer"] for i, r in enumerate(vf_tools.load_environment().dataset)},
        "hints": {
            str(i): r["answer"] for i, r in enumerate(vf_feedback.load_environment().dataset)
        },
    }
    tools = {"reverse": None, "tools": _tool_schemas(), "hints": None}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    scored = multi = 0
    for e in episodes:
        if e["stop_reason"] == "interrupted":  # in flight when the run ended
            continue
        assert e["stop_reason"] in {"done", "max_turns", "env_error"}, e["error"]
        if e["error"] is not None:  # e.g. an empty answer, which verifiers refuses
            assert e["error"]["where"] == "environment"
            continue
        segments = e["segments"]
        assert segments
        assert segments[0]["prompt_len"] == e["prompt_len"]
        rendered = tokenizer.apply_chat_template(
            e["messages"][: _first_assistant(e["messages"])],
            tools=tools[e["environment"]],
            add_generation_prompt=True,
            tokenize=False,
        )  # the first prompt is the chat template's render of the environment's prompt
        assert e["token_ids"][: e["prompt_len"]] == tokenizer.encode(
            rendered, add_special_tokens=False
        )
        for seg in segments:  # each call's tokens sit where it says, with their log probs
            start = seg["prompt_len"]
            assert e["token_ids"][start : start + len(seg["token_ids"])] == seg["token_ids"]
            assert len(seg["logprobs"]) == len(seg["token_ids"])
            assert seg["policy_version"]["start"] <= seg["policy_version"]["end"]
        for before, after in itertools.pairwise(segments):  # what the environment said
            between = e["token_ids"][
                before["prompt_len"] + len(before["token_ids"]) : after["prompt_len"]
            ]
            text = tokenizer.decode(between)
            said_by_env = "No. Hint: it starts with" if e["environment"] == "hints" else "<tool_"
            assert said_by_env in text
            assert text.endswith("<|im_start|>assistant\n")
            multi += 1
        answer = answers[e["environment"]][e["task_id"]]
        said = (_last_answer(e["messages"]) or "").strip()
        if e["environment"] == "reverse":
            overlap = sum(a == b for a, b in zip(said, answer, strict=False)) / len(answer)
            assert e["rewards"]["exact"] == float(said == answer)
            assert e["rewards"]["overlap"] == pytest.approx(overlap)
            assert e["reward"] == pytest.approx(float(said == answer) + 0.5 * overlap)
        else:
            assert e["reward"] == float(said == answer)
        assert e["metadata"]["answer"] == answer  # the rollout's state, in the log
        if e["environment"] == "tools" and e["stop_reason"] == "done":  # it answered last
            assert e["metadata"]["tool_turns"] == len(e["segments"]) - 1
        scored += 1
    assert scored > 0
    assert multi > 0, "no multi-turn episode reached the log"

    batches = [r for r in records if r["type"] == "batch"]
    assert [b["produced_version"] for b in batches] == [1, 2]
    for b in batches:  # the staleness correction ran on the logged log probs
        assert b["metrics"]["is/kept_tokens"] > 0
        assert b["metrics"]["mismatch/logp_abs_mean"] < 0.02
    # the groups were decided by the drop rule, as for native environments
    events = read_events(run_dir)
    again = resimulate(events, trajectories=run_dir / "trajectories")
    assert again.ok, again.mismatches


def _first_assistant(messages: list[dict[str, object]]) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "assistant")


def _last_answer(messages: list[dict[str, object]]) -> str | None:
    content = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
    return content if isinstance(content, str) else None


def _tool_schemas() -> list[dict[str, object]]:
    return [
        {"type": "function", "function": t.model_dump(exclude_none=True)}
        for t in vf_tools.load_environment().tool_defs
    ]
