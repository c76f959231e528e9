"""Token-exact multi-turn prompts from any chat template.

The prompt of model call ``k + 1`` is the prompt of call ``k``, plus the tokens call ``k``
sampled, plus the tokens of the environment's new messages. Only those new messages are
tokenized; nothing already in the sequence, and no sampled token, is ever re-tokenized, so what
the policy saw is what it trains on.

Templates do not render a conversation as a stable prefix: Qwen3-style templates strip earlier
turns' reasoning and render the last assistant turn differently, Llama-3-style ones insert a
dated system header, Mistral-style ones fold the system prompt into the last ``[INST]``. So the
new messages' text is never found by diffing two renders of the real conversation. It is found
by rendering a fixed probe instead, ``[user "x", assistant SENTINEL, *new_messages]`` with the
generation prompt, and keeping what the template wrote after ``SENTINEL``: how the template
closes an assistant turn, renders these messages after one, and opens the next assistant turn.
The closing is then bridged from what the model actually sampled: if the model ended its turn on
a special token (``<|im_end|>``, ``<|eot_id|>``, ``<|eom_id|>``, ``</s>``, ``<|call|>``, …) and
the template closes assistant turns with one (``<|end|>`` where the model stopped on
``<|return|>`` included), the template's is left out and the model's own stays; a turn cut short
by ``max_tokens`` gets the template's whole closing.

:class:`ChatTokens` checks the template once, at start-up, with the probe (and a ``tool`` probe
when the environment has tools): a template that cannot render it, or that drops a plain
assistant turn's content when more messages follow, is a :class:`SprawlError` naming it.

Text from environments, tools and users never becomes control tokens: a message whose text
holds a special token's text (a tool echoing ``<|im_end|>\n<|im_start|>user…``) is rendered with a
marker in its place, and its text encoded as plain text (``split_special_tokens``) between the
template's own tokens (:func:`plain_text_ids`); other messages are encoded with the template's
text as before. A template that transforms such a text (trims it) gets it untransformed; one
that writes it as JSON (``| tojson``: gpt-oss's tool results) gets it as JSON writes it.

What the template does to *earlier* turns is recorded rather than applied:
:meth:`ChatTokens.history_rewritten` says whether the template, re-rendering the episode's
messages, would drop reasoning the model saw (Qwen3 and R1 strip it from earlier turns). Such an
episode trains on the context the model really had; a chat server replaying the conversation
through the template would show a later model call less. docs/environments.md says more.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from policies.wire.errors import SprawlError
from policies.wire.toolcalls import THINK_CLOSE, THINK_OPEN, Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REASONING_MARKERS = (THINK_OPEN, THINK_CLOSE)
_CHANNEL_TOKENS = ("<|channel|>", "<|message|>")  # gpt-oss's message channels
_SENTINEL = "\x00sprawl-sentinel\x00"
_PROBE: list[Message] = [
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": _SENTINEL},
]
_USER_PROBE: list[Message] = [{"role": "user", "content": "y"}]
_MARKER = re.compile(r"(\x00|\\u0000)sprawl-text-([0-9]+)\1")  # as written, or by `| tojson`
_TOOL_PROBE: list[Message] = [  # an id of 9 alphanumerics: Mistral's templates refuse others
    {"role": "tool", "tool_call_id": "call00000", "name": "probe", "content": "y"},
]


def _index(ids: list[int], token: int, start: int) -> int:
    """``ids.index(token, start)``, or -1."""
    try:
        return ids.index(token, start)
    except ValueError:
        return -1


def control_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The text of every special token of ``tokenizer``, longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    found = {t.content for t in added if t.special} | set(tokenizer.all_special_tokens)
    return sorted((t for t in found if t), key=len, reverse=True)


def mark_control_text(
    messages: Sequence[Message], control: Sequence[str]
) -> tuple[list[Message], list[str]]:
    """``messages`` with each text (a ``content`` string, or a text part's ``text``) that holds
    any of ``control`` replaced by a marker, and those texts in marker order."""
    texts: list[str] = []

    def mark(text: object) -> object:
        if not isinstance(text, str) or not any(c in text for c in control):
            return text
        texts.append(text)
        return f"\x00sprawl-text-{len(texts) - 1}\x00"

    out: list[Message] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = [
                {**p, "text": mark(p["text"])} if isinstance(p, dict) and "text" in p else p
                for p in content
            ]
            out.append({**m, "content": parts})
        else:
            out.append({**m, "content": mark(content)} if "content" in m else dict(m))
    return out, texts


def plain_text_ids(
    tokenizer: PreTrainedTokenizerBase, text: str, texts: Sequence[str]
) -> list[int]:
    """Token ids of a render holding :func:`mark_control_text`'s markers: the template's text
    with its special tokens, each marked text as plain text. A marker the template wrote as JSON
    (gpt-oss renders tool results with ``| tojson``) stands for its text as JSON writes it."""
    ids: list[int] = []
    at = 0
    for m in _MARKER.finditer(text):
        if m.start() > at:
            ids.extend(tokenizer.encode(text[at : m.start()], add_special_tokens=False))
        plain = texts[int(m.group(2))]
        if m.group(1) != "\x00":  # transformers' tojson: ensure_ascii off, no HTML escaping
            plain = json.dumps(plain, ensure_ascii=False)[1:-1]
        ids.extend(tokenizer.encode(plain, add_special_tokens=False, split_special_tokens=True))
        at = m.end()
    if at < len(text):
        ids.extend(tokenizer.encode(text[at:], add_special_tokens=False))
    return ids


class ChatTokens:
    """Renders initial prompts and continuations for one tokenizer and tool list.

    ``name`` names the template in errors (default: the tokenizer's ``name_or_path``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: list[dict[str, Any]] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        source = name or getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        self.name = f"the chat template of {source}"
        if not getattr(tokenizer, "chat_template", None):
            raise SprawlError(f"{source} has no chat template (tokenizer_config.json)")
        self._special_ids = set(tokenizer.all_special_ids)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in _CHANNEL_TOKENS]
        self._channels = [i for i in ids if isinstance(i, int) and i in self._special_ids]
        if len(self._channels) < len(ids):
            self._channels = []
        self._specials = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
        self._control = control_texts(tokenizer)
        # a template that ends an assistant turn with a special token, even a different one when
        # more messages follow (gpt-oss: <|return|> last, <|end|> in history), closes turns
        closing = self._leading_special(self._probe_suffix([], generation_prompt=False))
        self._closes_turns = closing is not None
        eos = tokenizer.eos_token
        self._closers = {eos} if isinstance(eos, str) else set()
        self._probe_suffix(_USER_PROBE)
        if self.tools:
            self._probe_suffix(_TOOL_PROBE)

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        tools: Any = self.tools  # transformers types tools as an invariant list
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert isinstance(text, str)
        return text

    def _probe_suffix(self, new_messages: list[Message], *, generation_prompt: bool = True) -> str:
        """What the template writes after a plain assistant turn's content, ``new_messages``
        included: the closing, the new messages, the next generation prompt. Tool results that
        the template renders only after their call come after the calling turn instead
        (:meth:`_tool_suffix`)."""
        try:
            text = self._render([*_PROBE, *new_messages], generation_prompt=generation_prompt)
        except Exception as exc:  # jinja2's TemplateError, or the template's raise_exception
            if any(m.get("role") == "tool" for m in new_messages) and generation_prompt:
                with contextlib.suppress(SprawlError):  # else: the plain probe's error
                    return self._tool_suffix(new_messages)
            roles = ", ".join(m["role"] for m in new_messages) or "nothing"
            raise SprawlError(
                f"{self.name} cannot render an assistant turn followed by {roles}: {exc}"
            ) from None
        at = text.find(_SENTINEL)
        if at == -1:
            raise SprawlError(
                f"{self.name} does not render an assistant turn's content when more messages "
                "follow, so sprawl cannot find where the environment's messages begin"
            )
        return text[at + len(_SENTINEL) :]

    def _tool_suffix(self, new_messages: list[Message]) -> str:
        """What the template writes after an assistant turn that made the calls ``new_messages``
        answer, for templates that render a tool result only after its call (gpt-oss names a
        result's function after the last call): the template's own closing of that turn, the
        messages, the next generation prompt. The turn's calls are rebuilt from the results."""
        calls = [
            {
                "id": m.get("tool_call_id") or _TOOL_PROBE[0]["tool_call_id"],
                "type": "function",
                "function": {"name": m.get("name") or "probe", "arguments": {}},
            }
            for m in new_messages
            if m.get("role") == "tool"
        ]
        probe = [_PROBE[0], {"role": "assistant", "content": "", "tool_calls": calls}]
        try:
            before = self._render(probe, generation_prompt=False)
            text = self._render([*probe, *new_messages], generation_prompt=True)
        except Exception as exc:  # jinja2's TemplateError, or the template's raise_exception
            raise SprawlError(
                f"{self.name} cannot render tool results after the calls they answer: {exc}"
            ) from None
        head = before.rstrip()  # up to the template's closing of the calling turn
        closing = next((t for t in self._specials if head.endswith(t)), "")
        head = head[: len(head) - len(closing)]
        if not text.startswith(head):
            raise SprawlError(
                f"{self.name} renders an assistant turn's calls differently when their results "
                "follow, so sprawl cannot find where the results begin"
            )
        return text[len(head) :]

    def _leading_special(self, text: str) -> str | None:
        stripped = text.lstrip()
        return next((t for t in self._specials if stripped.startswith(t)), None)

    def encode(self, text: str, texts: Sequence[str] = ()) -> list[int]:
        """``text``'s token ids; ``texts``: what its markers stand for (:func:`plain_text_ids`)."""
        if texts:
            return plain_text_ids(self.tokenizer, text, texts)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def initial(self, messages: list[Message]) -> list[int]:
        """Tokens of the opening messages plus the assistant generation prompt."""
        marked, texts = mark_control_text(messages, self._control)
        return self.encode(self._render(marked, generation_prompt=True), texts)

    def continuation(self, sampled: list[int], new_messages: list[Message]) -> list[int]:
        """Tokens to append after ``sampled`` so that the model answers ``new_messages``."""
        marked, texts = mark_control_text(new_messages, self._control)
        suffix = self._probe_suffix(marked)
        if sampled and sampled[-1] in self._special_ids:  # the model closed its turn itself
            sampled_tail = str(self.tokenizer.decode(sampled[-1:], skip_special_tokens=False))
            leading = self._leading_special(suffix)
            closes = self._closes_turns or leading in self._closers or leading == sampled_tail
            if leading is not None and closes:
                suffix = suffix.lstrip()[len(leading) :]
        return self.encode(suffix, texts)

    def assistant_text(self, sampled: list[int], markers: Iterable[str] = ()) -> str:
        """The text a tool parser reads: the sampled tokens decoded with every special token
        left out except ``markers`` (a dialect's call markers, e.g. ``[TOOL_CALLS]``, may be
        special tokens) and ``<think>`` / ``</think>``. A turn written in gpt-oss's channels
        (``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…``)
        reads as its analysis text, ``</think>``, then the other channels' text, unless
        ``markers`` keep ``<|channel|>`` (the ``openai`` parser reads harmony itself)."""
        markers = tuple(markers)
        if self._channels and self._channels[0] in sampled and _CHANNEL_TOKENS[0] not in markers:
            return self._channel_text(sampled, markers)
        keep = {self.tokenizer.convert_tokens_to_ids(m) for m in (*markers, *REASONING_MARKERS)}
        ids = [i for i in sampled if i not in self._special_ids or i in keep]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _channel_text(self, sampled: list[int], markers: Iterable[str]) -> str:
        """Each ``<|channel|>NAME…<|message|>TEXT`` up to the next special token, in one pass
        (positions only move forward: a turn of repeated channel tokens is read once)."""
        channel, message = self._channels
        analysis: list[str] = []
        other: list[str] = []
        pos = 0
        while (at := _index(sampled, channel, pos)) != -1:
            split = _index(sampled, message, at + 1)
            split = len(sampled) if split == -1 else split
            end = split + 1
            while end < len(sampled) and sampled[end] not in self._special_ids:
                end += 1
            name = str(self.tokenizer.decode(sampled[at + 1 : split], skip_special_tokens=True))
            (analysis if name.strip().startswith("analysis") else other).append(
                self.assistant_text(sampled[split + 1 : end], markers)
            )
            pos = max(end, split)
        content = "".join(other)
        return f"{''.join(analysis)}{THINK_CLOSE}{content}" if analysis else content

    def history_rewritten(self, messages: list[Message]) -> bool:
        """Whether the template, re-rendering ``messages``, leaves out reasoning an assistant
        turn of them had (the token history keeps it: it is what the model saw)."""
        reasoning = [
            str(m["reasoning_content"]).strip()
            for m in messages
            if m.get("role") == "assistant" and m.get("reasoning_content")
        ]
        if not reasoning:
            return False
        try:
            text = self._render(messages, generation_prompt=False)
        except Exception:  # a history the template refuses is not a rewrite we can measure
            return False
        return any(r not in text for r in reasoning)
