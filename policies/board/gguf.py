"""GGUF export of a served view: what llama.cpp's ``llama-server`` loads.

:func:`export_gguf` writes one version — a served view (HF-named tensors, e.g. a sidecar's
shadow or ``Board.load``) plus the board's base files (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, optional ``chat_template.jinja``) — as a GGUF file with the ``gguf``
package; :func:`materialize_gguf` does it for a board version (``orchestrate materialize
--format gguf``). Nothing is written next to the model and nothing is downloaded.

Guarantees:

- the file is written to ``<out>.tmp`` and renamed, so a reader never sees half a file, and a
  file a running server has mapped is never overwritten in place (a new name or a rename);
- tensor values are exact: 1-D tensors (norms, biases) are F32; matrices are F32 by default
  (``matrix_dtype="f32"``), an exact widening of bf16/f16/f32 views; ``"bf16"`` stores the bf16
  view's bits unchanged at half the size, but ggml's BF16 matmul rounds the *activations* to
  bf16 as well, which moves log probs by ~1e-3 against the reference engine (F32: ~1e-6), so
  F32 is the default for exact serving;
- the output is deterministic: the same view and base files give the same bytes;
- anything llama.cpp would load differently is refused with :class:`ExportError` naming it: a
  ``model_type`` other than ``qwen2`` (sprawl's models), rope scaling, sliding windows, an
  activation other than SiLU, a tokenizer other than byte-level BPE with Qwen2's pre-tokenizer
  regex, token ids beyond ``vocab_size``, non-float views (fp8 / int4 / nvfp4 served views need
  a dequantizing export, not covered), and missing or unexpected tensors.

Tokenizer metadata: ``tokenizer.ggml.model = gpt2`` (byte-level BPE), ``pre = qwen2``, tokens in
id order (rows beyond the tokenizer are ``[PAD<id>]`` / UNUSED), special added tokens CONTROL,
other added tokens (sprawl's tool markers) USER_DEFINED, merges as ``"a b"``. The model has no
BOS; llama.cpp's BPE vocab would default BOS to id 11 (an ordinary token), so the pad token is
named BOS and ``add_bos_token`` is false (BOS is only inserted for text prompts anyway).
``general.sampling.*`` is never written: llama.cpp would take it as the server's default sampling.
Not covered: architectures other than Qwen2, quantized GGUF types.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import gguf
import torch
from gguf import MODEL_ARCH, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, TokenType

from policies.board.read import BoardReader
from policies.board.types import BASE_FILES
from policies.errors import ExportError

MatrixDtype = Literal["f32", "bf16"]
MATRIX_DTYPES: tuple[MatrixDtype, ...] = ("f32", "bf16")

ARCH = gguf.MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2]  # "qwen2"
# Qwen2's PRETOKENIZE_REGEX; llama.cpp's tokenizer.ggml.pre == "qwen2" splits with it.
QWEN2_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
REQUIRED_BASE = ("config.json", "tokenizer.json", "tokenizer_config.json")

_LAYER: dict[str, MODEL_TENSOR] = {
    "input_layernorm": MODEL_TENSOR.ATTN_NORM,
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "post_attention_layernorm": MODEL_TENSOR.FFN_NORM,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
}
_GLOBAL: dict[str, MODEL_TENSOR] = {
    "model.embed_tokens": MODEL_TENSOR.TOKEN_EMBD,
    "model.norm": MODEL_TENSOR.OUTPUT_NORM,
    "lm_head": MODEL_TENSOR.OUTPUT,
}
_BIASED = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def gguf_tensor_name(hf_name: str, n_layers: int) -> str:
    """``model.layers.3.mlp.up_proj.weight`` → ``blk.3.ffn_up.weight`` (llama.cpp's qwen2 names)."""
    stem, _, suffix = hf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL:
            return f"{TENSOR_NAMES[_GLOBAL[stem]]}.{suffix}"
        parts = stem.split(".", 3)
        layered = len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER
        if layered and parts[2].isdigit() and int(parts[2]) < n_layers:
            kind = _LAYER[parts[3]]
            return f"{TENSOR_NAMES[kind].format(bid=int(parts[2]))}.{suffix}"
    raise ExportError(
        f"tensor {hf_name!r} has no llama.cpp qwen2 name (num_hidden_layers={n_layers})"
    )


def base_files(directory: Path) -> dict[str, bytes]:
    """The base files present in ``directory`` (an HF model dir or a board's ``base/`` copy)."""
    return {n: (directory / n).read_bytes() for n in BASE_FILES if (directory / n).exists()}


def _json(base: Mapping[str, bytes], name: str) -> dict[str, Any]:
    if name not in base:
        raise ExportError(f"GGUF export needs the base file {name} (have: {sorted(base)})")
    try:
        value = json.loads(base[name])
    except ValueError as exc:
        raise ExportError(f"base file {name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ExportError(f"base file {name} is not a JSON object")
    return value


def _check_architecture(cfg: Mapping[str, Any]) -> None:
    if cfg.get("model_type") != "qwen2":
        raise ExportError(
            f"config.json model_type {cfg.get('model_type')!r}: GGUF export supports qwen2 only"
        )
    scaling = cfg.get("rope_scaling") or {}
    params = cfg.get("rope_parameters") or {}
    rope = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default"
    if rope != "default":
        raise ExportError(f"config.json rope type {rope!r}: only default RoPE is exported")
    if cfg.get("use_sliding_window"):
        raise ExportError("config.json use_sliding_window=true is not supported by GGUF export")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ExportError(f"config.json hidden_act {cfg.get('hidden_act')!r}: qwen2 uses silu")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    if int(cfg.get("head_dim") or hidden // heads) * heads != hidden:
        raise ExportError("config.json head_dim * num_attention_heads != hidden_size")


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _write_tokenizer(w: gguf.GGUFWriter, base: Mapping[str, bytes], cfg: Mapping[str, Any]) -> None:
    tok, tcfg = _json(base, "tokenizer.json"), _json(base, "tokenizer_config.json")
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError("tokenizer.json: only byte-level BPE tokenizers are exported")
    splits = [
        p.get("pattern", {}).get("Regex")
        for p in (tok.get("pre_tokenizer") or {}).get("pretokenizers", [])
        if p.get("type") == "Split"
    ]
    if splits != [QWEN2_PRETOKENIZE]:
        raise ExportError(
            "tokenizer.json: the pre-tokenizer is not Qwen2's split regex, which llama.cpp "
            "would apply (tokenizer.ggml.pre = qwen2)"
        )
    vocab: dict[str, int] = {str(k): int(v) for k, v in model["vocab"].items()}
    added = {int(t["id"]): t for t in tok.get("added_tokens", [])}
    for tid, t in added.items():
        vocab[str(t["content"])] = tid
    n_vocab = int(cfg["vocab_size"])
    by_id: dict[int, str] = {}
    for text, tid in vocab.items():
        if by_id.setdefault(tid, text) != text:
            raise ExportError(f"tokenizer.json: id {tid} has two tokens {by_id[tid]!r}, {text!r}")
    if max(by_id) >= n_vocab:
        raise ExportError(f"tokenizer.json has id {max(by_id)} >= config vocab_size {n_vocab}")
    tokens: list[str] = []
    types: list[int] = []
    for tid in range(n_vocab):
        if tid not in by_id:  # embedding rows beyond the tokenizer
            tokens.append(f"[PAD{tid}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(by_id[tid])
            kind = TokenType.NORMAL
            if tid in added:
                special = added[tid].get("special")
                kind = TokenType.CONTROL if special else TokenType.USER_DEFINED
            types.append(kind)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])

    def token_id(key: str) -> int | None:
        value = cfg.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
        named = tcfg.get(f"{key}_token")
        if isinstance(named, dict):
            named = named.get("content")
        return vocab.get(named) if isinstance(named, str) else None

    eos, pad, bos = token_id("eos"), token_id("pad"), token_id("bos")
    if eos is not None:
        w.add_eos_token_id(eos)
    if pad is not None:
        w.add_pad_token_id(pad)
    bos = bos if bos is not None else pad
    if bos is not None:
        w.add_bos_token_id(bos)
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    w.add_add_eos_token(bool(tcfg.get("add_eos_token", False)))
    template = tcfg.get("chat_template")
    if template is None and "chat_template.jinja" in base:
        template = base["chat_template.jinja"].decode()
    if isinstance(template, str):
        w.add_chat_template(template)


def _order(hf_name: str) -> tuple[int, int, str]:
    parts = hf_name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return (1, int(parts[2]), hf_name)
    return (0 if "embed" in hf_name else 2, 0, hf_name)


def _expected(n_layers: int, tied: bool, biased: bool) -> set[str]:
    want = {
        f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight",
        f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]}.weight",
    }
    if not tied:
        want.add(f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight")
    for bid in range(n_layers):
        want |= {f"{TENSOR_NAMES[k].format(bid=bid)}.weight" for k in _LAYER.values()}
        if biased:
            want |= {f"{TENSOR_NAMES[k].format(bid=bid)}.bias" for k in _BIASED}
    return want


def export_gguf(
    view: Mapping[str, torch.Tensor],
    base: Mapping[str, bytes],
    out: Path,
    *,
    matrix_dtype: MatrixDtype = "f32",
    name: str = "sprawl",
) -> Path:
    """Write ``view`` with ``base``'s config and tokenizer to the GGUF file ``out``."""
    if matrix_dtype not in MATRIX_DTYPES:
        raise ExportError(f"matrix dtype {matrix_dtype!r}: one of {', '.join(MATRIX_DTYPES)}")
    cfg = _json(base, "config.json")
    _check_architecture(cfg)
    n_layers = int(cfg["num_hidden_layers"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    tensors = dict(view)
    if tied:
        tensors.pop("lm_head.weight", None)  # llama.cpp's qwen2 loader reuses token_embd
    for key, t in tensors.items():
        if t.dtype not in _FLOATS:
            raise ExportError(
                f"{key}: dtype {t.dtype}; GGUF export takes float views (bfloat16, float16, "
                "float32), not quantized ones"
            )
        if t.ndim not in (1, 2):
            raise ExportError(f"{key}: {t.ndim}-D tensors do not occur in qwen2")
        if matrix_dtype == "bf16" and t.ndim == 2 and t.dtype != torch.bfloat16:
            raise ExportError(f"{key}: matrix dtype bf16 would round {t.dtype} values; use f32")
    names = {gguf_tensor_name(k, n_layers): k for k in tensors}
    biased = "model.layers.0.self_attn.q_proj.bias" in tensors
    expected = _expected(n_layers, tied, biased)
    if set(names) != expected:
        missing, extra = sorted(expected - set(names)), sorted(set(names) - expected)
        raise ExportError(f"view does not fit qwen2: missing {missing[:4]}, unexpected {extra[:4]}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        writer.add_name(name)
        writer.add_file_type(
            gguf.LlamaFileType.ALL_F32 if matrix_dtype == "f32" else gguf.LlamaFileType.MOSTLY_BF16
        )
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_vocab_size(int(cfg["vocab_size"]))
        writer.add_context_length(int(cfg["max_position_embeddings"]))
        writer.add_embedding_length(int(cfg["hidden_size"]))
        writer.add_block_count(n_layers)
        writer.add_feed_forward_length(int(cfg["intermediate_size"]))
        writer.add_head_count(int(cfg["num_attention_heads"]))
        writer.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
        writer.add_rope_freq_base(_rope_theta(cfg))
        writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
        _write_tokenizer(writer, base, cfg)
        for key in sorted(tensors, key=_order):
            t = tensors[key].detach().cpu().contiguous()
            gname = gguf_tensor_name(key, n_layers)
            if t.ndim == 1 or matrix_dtype == "f32":
                writer.add_tensor(gname, t.to(torch.float32).numpy())
            else:  # numpy has no bfloat16: the raw 16-bit patterns, typed BF16
                writer.add_tensor(
                    gname, t.view(torch.int16).numpy(), raw_dtype=GGMLQuantizationType.BF16
                )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, out)
    return out


def materialize_gguf(
    board: BoardReader, version: int, out: Path, *, matrix_dtype: MatrixDtype = "f32"
) -> Path:
    """Write ``version`` of ``board`` (verified, anchor + patches, and its base files) as the
    GGUF file ``out``."""
    base = board.base_files()
    _, view = board.load(version)  # refused unless it records these base files
    return export_gguf(
        view,
        base,
        out,
        matrix_dtype=matrix_dtype,
        name=gguf_name(board.run, version),
    )


def gguf_name(run: str, version: int) -> str:
    """``general.name`` of a version's GGUF (the same from a sidecar and from materialize)."""
    return f"{run} v{version}"
