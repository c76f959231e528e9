"""The byte-level BPE tokenizer of sprawl's own models, and the tokens a chat template needs.

:func:`build_tokenizer` trains a byte-level BPE with ``tokenizers`` on text from
``policies.model.corpus``, with the chat-control special tokens ``<|endoftext|>`` (pad),
``<|im_start|>``, ``<|im_end|>`` (eos) and the tool-call markers ``<tool_call>``,
``</tool_call>``, ``<tool_response>``, ``</tool_response>``, and wraps it with the Hermes-style
chat template ``policies.wire.toolcalls.CHAT_TEMPLATE``.

Another Jinja template ``T`` (:func:`chat_spec`) gets the tokens it needs instead, worked out by
:func:`policies.model.chat_template.template_tokens`: ``<|endoftext|>`` (pad) and every control
token ``T`` writes (``<|eot_id|>``, ``[INST]``, ``<s>``, …) as special tokens; the tool markers and
``<think>``, ``</think>`` as plain added tokens; ``eos_token`` = the token ``T`` closes an
assistant turn with; a ``bos_token`` when ``T`` reads one. The BPE is trained with fewer merges
so that the vocabulary stays ``ModelSpec.vocab_size`` (when the template's tokens leave no room
for merges, it is larger, and the model follows it).

Guarantees:

- Deterministic: the tokenizer depends on the size and the template only (its corpus seed is
  fixed), so every seed of a size shares token ids.
- The tool-call markers (and, with a template, ``<think>``, ``</think>``) are *added but not
  special* tokens (as in Qwen2.5): one id each, and they survive
  ``decode(..., skip_special_tokens=True)``, so the engine can parse calls from decoded text.
  ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` (or the template's control tokens) are
  special.
- The tokenizer pipeline is exactly Qwen2's (NFC, Qwen's split pattern, byte level), and the
  saved ``tokenizer_config.json`` (:func:`portable_tokenizer_config`) names ``Qwen2Tokenizer``
  with ``additional_special_tokens``; so transformers 5 (which rebuilds Qwen2 tokenizers from
  vocab + merges), transformers 4.46+ and the raw ``tokenizer.json`` all give the same ids.
  Digits are single tokens.
- ``decode(encode(s)) == s`` for NFC text, which includes all ASCII (NFC is the one lossy step).
- A template that cannot be read or rendered, or that closes no assistant turn with a control
  token, is a :class:`~policies.errors.ModelBuildError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from policies.model.chat_template import read_template, template_tokens
from policies.model.corpus import generate_corpus
from policies.model.sizes import SPECS, ModelSize
from policies.wire.toolcalls import (
    CHAT_TEMPLATE,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
TOOL_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)

# The tokenizer's training text is fixed per size, so all seeds of a size share one vocabulary.
CORPUS_SEED = 20240601

# transformers 5 loads every `model_type: qwen2` checkpoint through Qwen2Tokenizer, which rebuilds
# the pipeline around the saved vocab and merges: NFC normalizer, Qwen's split pattern (single
# digits, letter runs, punctuation runs, newline runs), byte-level mapping. We train with exactly
# that pipeline, taking the pattern from transformers itself, so the tokenizer every loader sees
# (tokenizers, transformers 4 or 5, vLLM) is the one that was trained.
_SPLIT_PATTERN: str = PRETOKENIZE_REGEX


@dataclass(frozen=True)
class ChatSpec:
    """The chat side of a tokenizer: its template, added tokens, eos (``eos[0]`` is the
    tokenizer's ``eos_token``; all are stop tokens) and bos."""

    template: str
    special: tuple[str, ...]
    plain: tuple[str, ...]
    eos: tuple[str, ...]
    bos: str | None = None
    source: str = "sprawl"  # where the template came from, for logs


DEFAULT_CHAT = ChatSpec(CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS, (EOS_TOKEN,))


def chat_spec(chat_template: str | Path | None) -> ChatSpec:
    """The tokens a chat template needs (a ``Path`` is read; ``None`` is sprawl's own template)."""
    if chat_template is None:
        return DEFAULT_CHAT
    if isinstance(chat_template, Path):
        source, text = str(chat_template), read_template(chat_template)
    else:
        source, text = "<text>", chat_template
    tokens = template_tokens(text, f"chat template {source}")
    special = (PAD_TOKEN, *(t for t in tokens.control if t != PAD_TOKEN))
    plain = tuple(t for t in (*TOOL_TOKENS, THINK_OPEN, THINK_CLOSE) if t not in special)
    return ChatSpec(text, special, plain, tokens.eos, tokens.bos, source)


def build_tokenizer(
    size: ModelSize = "tiny", chat: ChatSpec = DEFAULT_CHAT
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer for ``size`` and wrap it with ``chat``'s template."""
    spec = SPECS[size]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(chat.plain),
        min_frequency=2,
        special_tokens=list(chat.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(spec.corpus_docs, CORPUS_SEED), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.plain])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=chat.bos,
        eos_token=chat.eos[0],
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(chat.special),
        chat_template=chat.template,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def portable_tokenizer_config(saved: dict[str, object], chat: ChatSpec) -> dict[str, object]:
    """The saved config, rewritten in the form transformers 4.x and 5.x both load."""
    config = dict(saved)
    config.pop("extra_special_tokens", None)  # 5.x spelling; 4.x expects a dict there
    config.pop("backend", None)
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["additional_special_tokens"] = list(chat.special)
    config["bos_token"] = chat.bos
    config["eos_token"] = chat.eos[0]
    config["chat_template"] = chat.template
    return config


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The one id of ``token`` (a ``TypeError`` when it maps to none or several)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{token!r} does not map to one token id: {found!r}")
    return found
