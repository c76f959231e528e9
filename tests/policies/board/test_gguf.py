"""GGUF export: read back with gguf's own reader, names, dtypes and values bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from policies.board.cli import materialize
from policies.board.gguf import base_files, export_gguf, gguf_name, gguf_tensor_name
from policies.errors import ExportError
from tests.support.boards import tiny_board


@pytest.fixture(scope="module")
def view(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> dict[str, bytes]:
    return base_files(tiny_model_dir)


def _field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_f32_export_is_bit_exact(
    tmp_path: Path, view: dict[str, torch.Tensor], base: dict[str, bytes]
) -> None:
    out = export_gguf(view, base, tmp_path / "m.gguf")
    reader = GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    layers = json.loads(base["config.json"])["num_hidden_layers"]
    # tied embeddings: llama.cpp reuses token_embd, so lm_head is not written
    expected = {gguf_tensor_name(k, layers): k for k in view if k != "lm_head.weight"}
    assert set(tensors) == set(expected)
    for name, hf in expected.items():
        t = tensors[name]
        assert t.tensor_type == GGMLQuantizationType.F32
        back = torch.from_numpy(np.asarray(t.data).copy()).reshape(view[hf].shape)
        assert torch.equal(back, view[hf].float()), name
    assert not (tmp_path / "m.gguf.tmp").exists()


def test_bf16_export_keeps_the_view_bits(
    tmp_path: Path, view: dict[str, torch.Tensor], base: dict[str, bytes]
) -> None:
    reader = GGUFReader(export_gguf(view, base, tmp_path / "m.gguf", matrix_dtype="bf16"))
    for t in reader.tensors:
        hf = next(k for k in view if gguf_tensor_name(k, 2) == t.name)
        if view[hf].ndim == 1:
            assert t.tensor_type == GGMLQuantizationType.F32
            continue
        assert t.tensor_type == GGMLQuantizationType.BF16
        bits = np.asarray(t.data).view(np.int16).reshape(view[hf].shape)
        assert np.array_equal(bits, view[hf].view(torch.int16).numpy()), t.name


def test_tokenizer_metadata(
    tmp_path: Path,
    view: dict[str, torch.Tensor],
    base: dict[str, bytes],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    reader = GGUFReader(export_gguf(view, base, tmp_path / "m.gguf", name="run v3"))
    assert _field(reader, "general.architecture") == "qwen2"
    assert _field(reader, "general.name") == "run v3"
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert tokens == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    types = _field(reader, "tokenizer.ggml.token_type")
    assert isinstance(types, list)
    assert types[:3] == [TokenType.CONTROL] * 3  # <|endoftext|>, <|im_start|>, <|im_end|>
    tool = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert isinstance(tool, int)
    assert types[tool] == TokenType.USER_DEFINED
    assert types[100] == TokenType.NORMAL
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 0  # the pad token, never added
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    merges = _field(reader, "tokenizer.ggml.merges")
    assert isinstance(merges, list)
    assert merges
    assert all(isinstance(m, str) and " " in m for m in merges)
    assert _field(reader, "qwen2.context_length") == 2048
    assert not any(k.startswith("general.sampling") for k in reader.fields)


def test_export_is_deterministic(
    tmp_path: Path, view: dict[str, torch.Tensor], base: dict[str, bytes]
) -> None:
    a = export_gguf(view, base, tmp_path / "a.gguf").read_bytes()
    assert export_gguf(view, base, tmp_path / "b.gguf").read_bytes() == a


def test_unsupported_inputs_are_refused(
    tmp_path: Path, view: dict[str, torch.Tensor], base: dict[str, bytes]
) -> None:
    out = tmp_path / "m.gguf"
    llama = {**base, "config.json": json.dumps({"model_type": "llama"}).encode()}
    with pytest.raises(ExportError, match="model_type 'llama'"):
        export_gguf(view, llama, out)
    with pytest.raises(ExportError, match=r"tokenizer\.json"):
        export_gguf(view, {k: v for k, v in base.items() if k != "tokenizer.json"}, out)
    fp8 = {**view, "model.norm.weight": view["model.norm.weight"].to(torch.float8_e4m3fn)}
    with pytest.raises(ExportError, match="float views"):
        export_gguf(fp8, base, out)
    missing = {k: v for k, v in view.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ExportError, match=r"missing \['blk.1.ffn_up.weight'\]"):
        export_gguf(missing, base, out)
    with pytest.raises(ExportError, match=r"has no llama\.cpp qwen2 name"):
        export_gguf({**view, "model.extra.weight": view["model.norm.weight"]}, base, out)
    f32 = {k: v.float() for k, v in view.items()}
    with pytest.raises(ExportError, match="would round"):
        export_gguf(f32, base, out, matrix_dtype="bf16")
    assert not out.exists()


def test_materialize_format_gguf(
    tmp_path: Path, tiny_model_dir: Path, base: dict[str, bytes]
) -> None:
    board = tiny_board(tmp_path, tiny_model_dir)
    out = tmp_path / "v0.gguf"
    args = ["--board", board.url, "--run", board.run, "--version", "0"]
    assert materialize([*args, "--format", "gguf", "--out", str(out)]) == 0
    _, loaded = board.load(0)
    direct = export_gguf(loaded, base, tmp_path / "direct.gguf", name=gguf_name(board.run, 0))
    assert out.read_bytes() == direct.read_bytes()
    assert materialize([*args, "--out", str(tmp_path / "hf")]) == 0  # the default stays HF
    assert (tmp_path / "hf" / "model.safetensors").exists()
