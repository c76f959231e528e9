"""Token-exact multi-turn prompts from a chat template.

The prompt of model call ``k + 1`` is the prompt of call ``k``, plus the tokens call ``k``
sampled, plus the tokens of the environment's new messages. Only those new messages are
tokenized; nothing already in the sequence is ever re-tokenized.

The new messages' text is found by rendering a two-message reference conversation with and
without them and taking the difference; the template's text that closes an assistant turn
(e.g. ``<|im_end|>\\n``) is bridged from what the model actually sampled: if the model ended with
the end-of-turn token, only the rest of the closing text is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from policies.wire.toolcalls import Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
_SENTINEL = "\x00sprawl-sentinel\x00"


class ChatTokens:
    """Renders initial prompts and continuations for one tokenizer and tool list."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        ref = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        closed = self._render(ref, generation_prompt=False)
        self._assistant_close = closed[closed.index(_SENTINEL) + len(_SENTINEL) :]
        self._ref = ref
        self._ref_text = closed

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        tools: Any = self.tools  # transformers types tools as an invariant list
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def initial(self, messages: list[Message]) -> list[int]:
        """Tokens of the opening messages plus the assistant generation prompt."""
        return self.encode(self._render(messages, generation_prompt=True))

    def continuation(self, sampled: list[int], new_messages: list[Message]) -> list[int]:
        """Tokens to append after ``sampled`` so that the model answers ``new_messages``."""
        full = self._render([*self._ref, *new_messages], generation_prompt=True)
        if not full.startswith(self._ref_text):
            raise ValueError("chat template does not render conversations as stable prefixes")
        suffix = full[len(self._ref_text) :]
        closing = self._assistant_close
        ended_on_special = bool(sampled) and sampled[-1] in self.tokenizer.all_special_ids
        tail = str(self.tokenizer.decode(sampled[-1:], skip_special_tokens=False))
        if ended_on_special and closing.startswith(tail):
            closing = closing[len(tail) :]
        return self.encode(closing + suffix)
