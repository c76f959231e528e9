"""The project's own tiny *real* model, built offline: tokenizer, chat template and weights.

Nothing may come from a model hub, so ``init_model(out, size, seed)`` makes one from scratch:

1. a byte-level BPE tokenizer trained on generated text, with sprawl's chat-control and
   tool-call tokens (:mod:`policies.model.tokenizer`);
2. the Hermes-style chat template ``policies.wire.toolcalls.CHAT_TEMPLATE``, stored in
   ``tokenizer_config.json``;
3. a randomly initialised ``Qwen2ForCausalLM`` (tied embeddings, float32) of the size's shape
   (:mod:`policies.model.sizes`) whose vocabulary is the tokenizer's, saved in HF layout:
   ``config.json``, ``generation_config.json``, ``model.safetensors``. Size ``tiny-moe`` is a
   ``Qwen3MoeForCausalLM`` instead (the tiny model's tokenizer, attention and depth; every
   layer's MLP a mixture of 8 experts, 2 routed per token), the model router replay is measured
   on (:mod:`policies.model.moe`).

``init_model(..., chat_template=T)`` stores another Jinja template instead (a ``Path`` is read
from that file, a ``str`` is the template itself; ``examples/chat_templates/`` has one per model
family sprawl is tested against), and the tokenizer gets the tokens ``T`` needs
(:func:`policies.model.tokenizer.chat_spec`); ``generation_config.eos_token_id`` is the id of the
token ``T`` closes an assistant turn with, or the list of ids when a tool-call turn closes with
another one (``<|call|>``). ``tool_parser=NAME`` (one of ``TOOL_PARSERS``) is written to
``<out>/sprawl.json`` as ``{"tool_parser": NAME}``, the parser an engine should read this model's
calls with; without one, a ``sprawl.json`` left in ``out`` by an earlier build is removed.

Guarantees:

- Offline and deterministic: the same ``(size, seed, chat_template)`` gives byte-identical files
  (``model.safetensors``, ``tokenizer.json``, …) on a given torch/transformers/tokenizers
  version. Every seed of a size shares token ids; ``seed`` drives the weight init, under a forked
  torch RNG so the caller's global RNG is left untouched.
- ``AutoTokenizer.from_pretrained(out)`` and ``AutoModelForCausalLM.from_pretrained(out)`` load
  the result with ``HF_HUB_OFFLINE=1``; ``apply_chat_template(messages, tools=...)`` works. The
  tokenizer's guarantees (which tokens are special, the pipeline, round trips) are
  :mod:`policies.model.tokenizer`'s.
- A template that cannot be read or rendered, or that closes no assistant turn with a control
  token, and an unknown ``tool_parser``, are a :class:`~policies.errors.ModelBuildError`
  naming the file, raised before anything is built or written.
- Each file is written to a temporary sibling first and moved into ``out``, so a crash never
  leaves a half-written file (it may leave a partial set; rerun to finish).

Not covered: a *trained* model. The weights are random; the model produces well-formed tokens,
not sensible text, until RL or SFT moves it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import structlog
import torch
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
from transformers.utils import logging as hf_logging

from policies.errors import ModelBuildError
from policies.model.chat_template import SPRAWL_JSON
from policies.model.sizes import SPECS, ModelSize, ModelSpec
from policies.model.tokenizer import (
    PAD_TOKEN,
    ChatSpec,
    build_tokenizer,
    chat_spec,
    portable_tokenizer_config,
    token_id,
)
from policies.wire.tool_parsers import TOOL_PARSERS

log = structlog.get_logger(__name__)


def _stop_ids(tokenizer: PreTrainedTokenizerFast, chat: ChatSpec) -> int | list[int]:
    ids = [token_id(tokenizer, t) for t in chat.eos]
    return ids[0] if len(ids) == 1 else ids


def _model_config(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, chat: ChatSpec
) -> PretrainedConfig:
    bos = None if chat.bos is None else token_id(tokenizer, chat.bos)
    eos, pad = _stop_ids(tokenizer, chat), token_id(tokenizer, PAD_TOKEN)
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
    _write_json(staging / "tokenizer_config.json", portable_tokenizer_config(saved, chat))
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
