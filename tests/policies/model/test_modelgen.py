"""The project's own model: built offline, loads through Auto* classes, generates, deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from structlog.testing import capture_logs
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from policies.model.build import init_model
from policies.model.corpus import generate_corpus
from policies.model.sizes import SPECS, ModelSize
from policies.model.tokenizer import SPECIAL_TOKENS, TOOL_TOKENS
from policies.wire.toolcalls import CHAT_TEMPLATE, parse_assistant

HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="session")
def model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # in eval mode already


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_hf_layout_and_config(tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == sorted(HF_FILES)
    config = read_json(tiny_model_dir / "config.json")
    spec = SPECS["tiny"]
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == len(tokenizer) == spec.vocab_size
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 2048
    generation = read_json(tiny_model_dir / "generation_config.json")
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    saved_template = read_json(tiny_model_dir / "tokenizer_config.json")["chat_template"]
    assert saved_template == CHAT_TEMPLATE
    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names  # tied to the embeddings


def test_special_and_tool_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        assert len(tokenizer.encode(token)) == 1, token
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tokenizer.encode(f"<|im_start|>assistant\n{call}<|im_end|>")
    # Chat-control tokens are special; tool markers must survive a skip-special decode.
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == f"assistant\n{call}"
    assert [c.name for c in parse_assistant(kept.removeprefix("assistant\n")).tool_calls] == ["f"]


def test_digits_are_single_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("37 * 12"))
    assert [t for t in tokens if t.isdigit()] == ["3", "7", "1", "2"]


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=200))
def test_ascii_text_round_trips(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=100) | st.sampled_from(generate_corpus(50, seed=7)))
def test_auto_tokenizer_is_the_trained_tokenizer(
    tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    # transformers may rebuild the pipeline from vocab + merges (Qwen2Tokenizer does); the ids
    # must still be those of the tokenizer.json we wrote.
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tokenizer.encode(text) == raw.encode(text).ids


def test_chat_template_survives_save_and_load(tokenizer: PreTrainedTokenizerBase) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is 37 * 12?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "37 * 12"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "444"},
    ]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": True, "tokenize": False}
    loaded = tokenizer.apply_chat_template(messages, **kwargs)
    assert loaded == tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, **kwargs)
    assert isinstance(loaded, str)
    assert loaded.endswith(
        "<tool_response>\n444\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_model_generates(model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 37 * 12?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    encoded = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        first_logits = model(**encoded).logits[0, -1]
    n_prompt = encoded["input_ids"].shape[1]
    assert out.shape == (1, n_prompt + 6)
    assert torch.equal(out[0, :n_prompt], encoded["input_ids"][0])
    assert out[0, n_prompt].item() == int(first_logits.argmax())
    assert isinstance(tokenizer.decode(out[0, n_prompt:]), str)


@pytest.mark.slow
def test_same_seed_same_bytes_other_seed_other_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    rng_before = torch.random.get_rng_state()
    with capture_logs() as logs:
        again = init_model(tmp_path / "again", "tiny", seed=0)
        other = init_model(tmp_path / "other", "tiny", seed=1)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # caller's RNG untouched
    assert [e["event"] for e in logs] == ["model_initialised", "model_initialised"]
    assert logs[1]["seed"] == 1
    for name in HF_FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    # The tokenizer depends on the size only, so every seed shares token ids.
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_loads_offline_in_a_fresh_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "ids = tok('What is 2 + 2?', return_tensors='pt')\n"
        "out = model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)\n"
        "print(json.dumps({'vocab': len(tok), 'new': out.shape[1] - ids['input_ids'].shape[1],"
        " 'dtype': str(model.dtype)}))\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "empty-hf-home"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"vocab": SPECS["tiny"].vocab_size, "new": 3, "dtype": "torch.float32"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "hidden", "layers", "heads", "kv_heads", "millions"),
    [("small", 256, 4, 8, 4, 3.95), ("medium", 1024, 8, 16, 8, 98.6)],
)
def test_larger_sizes_build_and_load_with_their_shapes(
    tmp_path: Path,
    size: ModelSize,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    millions: float,
) -> None:
    out = init_model(tmp_path / size, size, seed=3)
    config = read_json(out / "config.json")
    spec = SPECS[size]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (hidden, layers)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads, kv_heads)
    assert hidden // heads >= 32  # vLLM's CPU attention needs head_dim >= 32
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(out)) == spec.vocab_size
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape == (spec.vocab_size, hidden)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.1)
