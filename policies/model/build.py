"""The project's own tiny *real* model, built offline: tokenizer, chat template and weights.

Nothing may come from a model hub, so ``init_model(out, size, seed)`` makes one from scratch:

1. a byte-level BPE tokenizer trained with ``tokenizers`` on text from ``policies.model.corpus``,
   with the chat-control special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
   (eos) and the tool-call markers ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
   ``</tool_response>``;
2. the Hermes-style chat template ``policies.wire.toolcalls.CHAT_TEMPLATE``, stored in
   ``tokenizer_config.json``;
3. a randomly initialised ``Qwen2ForCausalLM`` (tied embeddings, float32) whose vocabulary is the
   tokenizer's, saved in HF layout: ``config.json``, ``generation_config.json``,
   ``model.safetensors``. Size ``tiny-moe`` is a ``Qwen3MoeForCausalLM`` instead (the tiny
   model's tokenizer, attention and depth; every layer's MLP a mixture of 8 experts, 2 routed per
   token), the model router replay is measured on (:mod:`policies.model.moe`).

``init_model(..., chat_template=T)`` stores another Jinja template instead (a ``Path`` is read
from that file, a ``str`` is the template itself; ``examples/chat_templates/`` has one per model
family sprawl is tested against). The tokenizer then gets the tokens ``T`` needs, worked out by
:func:`policies.model.chat_template.template_tokens`: ``<|endoftext|>`` (pad) and every control
token ``T`` writes (``<|eot_id|>``, ``[INST]``, ``<s>``, …) as special tokens; the tool markers and
``<think>``, ``</think>`` as plain added tokens; ``eos_token`` = the token ``T`` closes an
assistant turn with; ``generation_config.eos_token_id`` = that id, or the list of ids when a
tool-call turn closes with another one (``<|call|>``); a ``bos_token`` when ``T`` reads one.
The BPE is trained with fewer merges so that the vocabulary stays ``ModelSpec.vocab_size``
(when the template's tokens leave no room for merges, it is larger, and the model follows it).
``tool_parser=NAME`` (one of ``TOOL_PARSERS``) is written to ``<out>/sprawl.json`` as
``{"tool_parser": NAME}``, the parser an engine should read this model's calls with; without
one, a ``sprawl.json`` left in ``out`` by an earlier build is removed.

Guarantees:

- Offline and deterministic: the same ``(size, seed, chat_template)`` gives byte-identical files
  (``model.safetensors``, ``tokenizer.json``, …) on a given torch/transformers/tokenizers
  version. The tokenizer depends on ``size`` and the template only (its corpus seed is fixed),
  so every seed of a size shares token ids; ``seed`` drives the weight init, under a forked torch
  RNG so the caller's global RNG is left untouched.
- ``AutoTokenizer.from_pretrained(out)`` and ``AutoModelForCausalLM.from_pretrained(out)`` load
  the result with ``HF_HUB_OFFLINE=1``; ``apply_chat_template(messages, tools=...)`` works.
- The tool-call markers (and, with a template, ``<think>``, ``</think>``) are *added but not
  special* tokens (as in Qwen2.5): one id each, and they survive
  ``decode(..., skip_special_tokens=True)``, so the engine can parse calls from decoded text.
  ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` (or the template's control tokens) are
  special.
- A template that cannot be read or rendered, or that closes no assistant turn with a control
  token, and an unknown ``tool_parser``, are a :class:`~policies.errors.ModelBuildError`
  naming the file, raised before anything is built or written.
- The tokenizer pipeline is exactly Qwen2's (NFC, Qwen's split pattern, byte level), and
  ``tokenizer_config.json`` names ``Qwen2Tokenizer`` with ``additional_special_tokens``; so
  transformers 5 (which rebuilds Qwen2 tokenizers from vocab + merges), transformers 4.46+ and
  the raw ``tokenizer.json`` all give the same ids. Digits are single tokens.
- ``decode(encode(s)) == s`` for NFC text, which includes all ASCII (NFC is the one lossy step).
- Each file is written to a temporary sibling first and moved into ``out``, so a crash never
  leaves a half-written file (it may leave a partial set; rerun to finish).

Not covered: a *trained* model. The weights are random; the model produces well-formed tokens,
not sensible text, until RL or SFT moves it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import torch
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
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.utils import logging as hf_logging

from policies.errors import ModelBuildError
from policies.model.chat_template import (
    SPRAWL_JSON,
    read_template,
    template_tokens,
)
from policies.model.corpus import generate_corpus
from policies.wire.tool_parsers import TOOL_PARSERS
from policies.wire.toolcalls import (
    CHAT_TEMPLATE,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

log = structlog.get_logger(__name__)

ModelSize = Literal["tiny", "small", "medium", "large", "tiny-moe"]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
TOOL_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)

# sprawl's own per-model settings, next to the HF files (see ``init_model``).

# The tokenizer's training text is fixed per size, so all seeds of a size share one vocabulary.
CORPUS_SEED = 20240601

# transformers 5 loads every `model_type: qwen2` checkpoint through Qwen2Tokenizer, which rebuilds
# the pipeline around the saved vocab and merges: NFC normalizer, Qwen's split pattern (single
# digits, letter runs, punctuation runs, newline runs), byte-level mapping. We train with exactly
# that pipeline, taking the pattern from transformers itself, so the tokenizer every loader sees
# (tokenizers, transformers 4 or 5, vLLM) is the one that was trained.
_SPLIT_PATTERN: str = PRETOKENIZE_REGEX


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one model size; ``vocab_size`` counts the special and tool tokens; ``experts``
    > 0 makes it a Qwen3-MoE model, ``experts_per_token`` of them routed per token, each an MLP
    of ``expert_intermediate_size``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    corpus_docs: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0


SPECS: dict[ModelSize, ModelSpec] = {
    # Small enough that an RL demo runs on 2 CPU cores.
    "tiny": ModelSpec(2048, 64, 2, 4, 2, 176, 2048, corpus_docs=20_000),
    "small": ModelSpec(4096, 256, 4, 8, 4, 688, 2048, corpus_docs=40_000),
    # ~100 M parameters (0.2 GB served in bf16): what grows with the model, such as an engine's
    # reload of a version (``bench sync --engine``), measured at a size where it shows.
    "medium": ModelSpec(4096, 1024, 8, 16, 8, 2816, 2048, corpus_docs=40_000),
    # ~0.5 B parameters (1 GB in bf16): whether a version's cost grows with the patch or the model.
    "large": ModelSpec(4096, 1536, 20, 12, 4, 4096, 2048, corpus_docs=40_000),
    # The tiny model's tokenizer and attention, with a mixture of experts for its MLPs.
    "tiny-moe": ModelSpec(
        2048,
        64,
        2,
        4,
        2,
        176,
        2048,
        corpus_docs=20_000,
        experts=8,
        experts_per_token=2,
        expert_intermediate_size=64,
    ),
}


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


def _portable_tokenizer_config(saved: dict[str, object], chat: ChatSpec) -> dict[str, object]:
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


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"{token!r} does not map to one token id: {token_id!r}")
    return token_id


def _stop_ids(tokenizer: PreTrainedTokenizerFast, chat: ChatSpec) -> int | list[int]:
    ids = [_token_id(tokenizer, t) for t in chat.eos]
    return ids[0] if len(ids) == 1 else ids


def _model_config(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, chat: ChatSpec
) -> PretrainedConfig:
    bos = None if chat.bos is None else _token_id(tokenizer, chat.bos)
    eos, pad = _stop_ids(tokenizer, chat), _token_id(tokenizer, PAD_TOKEN)
    if spec.experts:
        return Qwen3MoeConfig(
            vocab_size=len(tokenizer),
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.expert_intermediate_size,
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            norm_topk_prob=True,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=True,
            dtype="float32",
            architectures=["Qwen3MoeForCausalLM"],
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        max_window_layers=spec.num_hidden_layers,
        tie_word_embeddings=True,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _save(
    staging: Path, tokenizer: PreTrainedTokenizerFast, model: PreTrainedModel, chat: ChatSpec
) -> None:
    tokenizer.save_pretrained(staging, save_jinja_files=False)
    saved = json.loads((staging / "tokenizer_config.json").read_text())
    _write_json(staging / "tokenizer_config.json", _portable_tokenizer_config(saved, chat))
    special_map: dict[str, object] = {
        "eos_token": chat.eos[0],
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(chat.special),
    }
    if chat.bos is not None:
        special_map["bos_token"] = chat.bos
    _write_json(staging / "special_tokens_map.json", special_map)
    # transformers' shard-writing progress bar is noise in a sub-second save; restore the
    # caller's setting afterwards.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        model.save_pretrained(staging)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    # transformers 5 writes `dtype`; transformers 4 before 4.56 reads only `torch_dtype`.
    config = json.loads((staging / "config.json").read_text())
    config["torch_dtype"] = config["dtype"]
    _write_json(staging / "config.json", config)


def init_model(
    out: Path,
    size: ModelSize = "tiny",
    seed: int = 0,
    chat_template: str | Path | None = None,
    tool_parser: str | None = None,
) -> Path:
    """Build the tokenizer and a random model (``Qwen2ForCausalLM``; ``Qwen3MoeForCausalLM`` for
    ``tiny-moe``) for ``(size, seed)`` in ``out``.

    ``chat_template``: a template file (``Path``) or text (``str``) to use instead of sprawl's
    own; ``tool_parser``: the parser name to record in ``sprawl.json``.
    """
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ModelBuildError(
            f"unknown tool parser {tool_parser!r}; choose one of {', '.join(TOOL_PARSERS)}"
        )
    chat = chat_spec(chat_template)
    spec = SPECS[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(size, chat)
    config = _model_config(spec, tokenizer, chat)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = (
            Qwen3MoeForCausalLM(config)
            if isinstance(config, Qwen3MoeConfig)
            else Qwen2ForCausalLM(config)  # type: ignore[arg-type]
        )
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        staging = Path(tmp)
        _save(staging, tokenizer, model, chat)
        if tool_parser is not None:
            _write_json(staging / SPRAWL_JSON, {"tool_parser": tool_parser})
        for item in sorted(staging.iterdir()):
            item.chmod(0o644)  # temporary files are private; the model is not
            os.replace(item, out / item.name)
    if tool_parser is None:
        (out / SPRAWL_JSON).unlink(missing_ok=True)  # an earlier build's parser is not this one's
    log.info(
        "model_initialised",
        out=str(out),
        size=size,
        seed=seed,
        vocab_size=len(tokenizer),
        chat_template=chat.source,
        eos=list(chat.eos),
        tool_parser=tool_parser,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return out
