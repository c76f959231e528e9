"""SFT warm start: ideal calculator episodes render exactly; fine-tuning moves the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
from transformers import PreTrainedTokenizerBase

from orchestrator.warm_start import calculator_env, format_score, ideal_example, warm_start
from policies.wire.chat_tokens import ChatTokens
from policies.wire.toolcalls import parse_assistant


def test_ideal_example_is_the_chat_template_rendering(tokenizer: PreTrainedTokenizerBase) -> None:
    env = calculator_env(8, seed=3)
    chat = ChatTokens(tokenizer, env.tool_schemas())
    for task in env.tasks():
        ids, mask = anyio.run(ideal_example, env, chat, dict(task))
        assert len(ids) == len(mask)
        text = str(tokenizer.decode(ids, skip_special_tokens=False))
        assert text.startswith(str(tokenizer.decode(chat.initial(env.initial_messages(task)))))
        # the masked (trained) tokens are exactly the two assistant turns, each through <|im_end|>
        spans: list[list[int]] = []
        for i, (tok, m) in enumerate(zip(ids, mask, strict=True)):
            if m:
                if i == 0 or not mask[i - 1]:
                    spans.append([])
                spans[-1].append(tok)
        assert len(spans) == 2
        call_text, answer_text = (str(tokenizer.decode(s, skip_special_tokens=True)) for s in spans)
        assert all(s[-1] == tokenizer.eos_token_id for s in spans)
        parsed = parse_assistant(call_text)
        assert not parsed.errors
        assert [c.name for c in parsed.tool_calls] == ["calculator"]
        expression = json.loads(parsed.tool_calls[0].arguments)["expression"]
        assert expression in task["question"]
        value = int(task["answer"])
        assert answer_text == f"The answer is {value}."
        # the tool's real output sits between the turns, outside the loss
        assert f"<tool_response>\n{value}\n</tool_response>" in text


def test_warm_start_lowers_the_loss_and_replaces_the_weights(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    before = (model_dir / "model.safetensors").read_bytes()
    result = warm_start(model_dir, steps=12, batch_size=4, num_tasks=16, eval_episodes=2)
    assert result.final_loss < result.first_loss
    assert (model_dir / "model.safetensors").read_bytes() != before
    assert not list(model_dir.glob(".sft-*"))
    recorded = json.loads((model_dir / "sft.json").read_text())
    assert recorded["steps"] == 12
    assert recorded["after"]["episodes"] == 2
    score = format_score(model_dir, 2, temperature=1.0, seed=1)
    assert 0.0 <= score.valid_tool_call <= 1.0
    assert score.episodes == 2
