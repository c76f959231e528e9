"""Multi-turn prompts are token-exact continuations on the demo model's template."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from environments.base import EnvConfig
from environments.calculator import Calculator
from policies.wire.chat_tokens import ChatTokens


def test_continuation_matches_full_render(tokenizer: PreTrainedTokenizerBase) -> None:
    tools = Calculator(EnvConfig()).tool_schemas()
    chat = ChatTokens(tokenizer, tools)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 3 * 4?"}]
    ids = chat.initial(messages)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    sampled = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    new = [{"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "12"}]
    ids = ids + sampled + chat.continuation(sampled, new)
    # The same conversation rendered whole, with the assistant turn as the model wrote it.
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": call}, *new],
        tools=tools,  # type: ignore[arg-type]
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tokenizer.decode(ids) == full


def test_continuation_after_length_stop_closes_the_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    chat = ChatTokens(tokenizer)
    sampled = tokenizer.encode("The answer is", add_special_tokens=False)  # cut by max_tokens
    cont = chat.continuation(sampled, [{"role": "user", "content": "go on"}])
    assert str(tokenizer.decode(cont)).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    assert str(tokenizer.decode(cont)).endswith("<|im_start|>assistant\n")
