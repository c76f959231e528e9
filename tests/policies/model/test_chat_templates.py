"""Models built for other families' chat templates (examples/chat_templates/): tokens, eos, bos,
and the family behaviour each template reproduces."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.cli import main
from policies.errors import ModelBuildError
from policies.model.build import init_model
from policies.model.chat_template import template_tokens
from policies.model.sizes import SPECS
from policies.wire.toolcalls import parse_assistant
from tests.support.models import model_copy

TEMPLATES = Path(__file__).resolve().parents[3] / "examples" / "chat_templates"
PAD = "<|endoftext|>"
PLAIN = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


@dataclass(frozen=True)
class Family:
    control: tuple[str, ...]  # the special tokens besides the pad, as the template writes them
    eos: tuple[str, ...]
    bos: str | None
    markers: tuple[str, ...]  # in the rendered tool conversation
    prompt_end: str  # how a prompt after a tool result ends
    hermes: bool  # calls are <tool_call> blocks


FAMILIES = {
    "qwen3_like": Family(
        ("<|im_start|>", "<|im_end|>"),
        ("<|im_end|>",),
        None,
        (
            "<|im_start|>system\nAnswer with a number.\n\n# Tools\n",
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12"}}\n'
            "</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n444\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n<think>\nThe tool says 444.\n</think>\n\n444<|im_end|>\n",
        ),
        "<|im_start|>assistant\n<think>\n",
        True,
    ),
    "llama3_like": Family(
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        ("<|eot_id|>",),
        "<|begin_of_text|>",
        (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
            "Today Date: 26 Jul 2024\n\nAnswer with a number.<|eot_id|>",
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calculator", '
            '"parameters": {"expression": "37 * 12"}}<|eot_id|>',
            "<|start_header_id|>ipython<|end_header_id|>\n\n444<|eot_id|>",
        ),
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        False,
    ),
    "mistral_like": Family(
        (
            "<s>",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "</s>",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        ("</s>",),
        "<s>",
        (
            '<s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "calculator"',
            "[/AVAILABLE_TOOLS][INST]Answer with a number.\n\nWhat is 37 * 12?[/INST]",
            '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "37 * 12"}, '
            '"id": "abc123XYZ"}]</s>',
            '[TOOL_RESULTS]{"content": "444", "call_id": "abc123XYZ"}[/TOOL_RESULTS]444</s>',
        ),
        "[/TOOL_RESULTS]",
        False,
    ),
    "r1_like": Family(
        (
            "<｜begin▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
            "<｜tool▁outputs▁end｜>",
        ),
        ("<｜end▁of▁sentence｜>",),
        "<｜begin▁of▁sentence｜>",
        (
            "<｜begin▁of▁sentence｜>Answer with a number.\n\n## Tools\n",
            "<｜User｜>What is 37 * 12?<｜Assistant｜><tool_call>\n",
            "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>444<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
            "<｜Assistant｜>444<｜end▁of▁sentence｜>",
        ),
        "<｜Assistant｜><think>\n",
        True,
    ),
    "gptoss_like": Family(
        ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>", "<|return|>"),
        ("<|return|>", "<|call|>"),
        None,
        (
            "<|start|>developer<|message|># Instructions\n\nAnswer with a number.\n\n# Tools",
            "<|start|>assistant to=functions.calculator<|channel|>commentary json<|message|>"
            '{"expression": "37 * 12"}<|call|>',
            "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>444<|end|>",
            "<|start|>assistant<|channel|>final<|message|>444<|return|>",
        ),
        "<|start|>assistant",
        False,
    ),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


CALL_ID = "abc123XYZ"  # 9 alphanumerics: Mistral's templates refuse any other id


def call(arguments: str | dict[str, Any]) -> dict[str, Any]:
    return {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": "calculator", "arguments": arguments},
    }


def conversation(arguments: str | dict[str, Any] = '{"expression": "37 * 12"}') -> list[Any]:
    return [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 37 * 12?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should use the calculator.",
            "tool_calls": [call(arguments)],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "name": "calculator", "content": "444"},
        {"role": "assistant", "content": "444", "reasoning_content": "The tool says 444."},
    ]


@dataclass(frozen=True)
class Built:
    out: Path
    tokenizer: PreTrainedTokenizerBase


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """One tiny model per template per session, from the machine-wide cache."""
    models: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in models:
            into = tmp_path_factory.mktemp("templates") / name
            out = model_copy("tiny", into, chat_template=TEMPLATES / f"{name}.jinja")
            models[name] = Built(out, AutoTokenizer.from_pretrained(out))
        return models[name]

    return get


def render(tokenizer: PreTrainedTokenizerBase, messages: list[Any], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_every_template_file_is_tested() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)
    for path in TEMPLATES.glob("*.jinja"):
        assert path.read_text().startswith("{#- "), path  # says what behaviour it reproduces


@pytest.mark.parametrize("name", FAMILIES)
def test_model_builds_with_the_templates_tokens(built: Callable[[str], Built], name: str) -> None:
    model = built(name)
    family = FAMILIES[name]
    tokenizer = model.tokenizer
    config = read_json(model.out / "config.json")
    assert config["vocab_size"] == len(tokenizer) == SPECS["tiny"].vocab_size
    with safe_open(model.out / "model.safetensors", framework="pt") as weights:
        assert weights.get_tensor("model.embed_tokens.weight").shape[0] == len(tokenizer)
    assert (
        read_json(model.out / "tokenizer_config.json")["chat_template"]
        == (TEMPLATES / f"{name}.jinja").read_text()
    )
    assert set(tokenizer.all_special_tokens) == {PAD, *family.control}
    for token in (PAD, *family.control, *PLAIN):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    for token in PLAIN:
        assert token not in tokenizer.all_special_tokens, token
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode(
        "hello", add_special_tokens=False
    )  # bos comes from the template, never from encode


@pytest.mark.parametrize("name", FAMILIES)
def test_tool_conversation_renders_the_family_markers(
    built: Callable[[str], Built], name: str
) -> None:
    family = FAMILIES[name]
    tokenizer = built(name).tokenizer
    text = render(tokenizer, conversation(), tools=TOOLS)
    for marker in family.markers:
        assert marker in text, marker
    # arguments as a JSON string or as a dict render alike
    assert render(tokenizer, conversation({"expression": "37 * 12"}), tools=TOOLS) == text
    prompt = render(tokenizer, conversation()[:4], tools=TOOLS, add_generation_prompt=True)
    assert prompt.endswith(family.prompt_end)
    # in context too, each control token is its one id
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token in family.control:
        assert ids.count(tokenizer.convert_tokens_to_ids(token)) == text.count(token), token
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(kept, str)
    assert not [t for t in family.control if t in kept]
    if family.hermes:  # the calls survive a skip-special decode and parse back
        block = kept[kept.index('<tool_call>\n{"name": "calculator"') :]
        calls = parse_assistant(block.split("</tool_call>")[0] + "</tool_call>")
        assert [(c.name, json.loads(c.arguments)) for c in calls.tool_calls] == [
            ("calculator", {"expression": "37 * 12"})
        ]


@pytest.mark.parametrize("name", FAMILIES)
def test_eos_is_how_the_template_closes_assistant_turns(
    built: Callable[[str], Built], name: str
) -> None:
    model = built(name)
    family = FAMILIES[name]
    tokenizer = model.tokenizer
    assert tokenizer.eos_token == family.eos[0]
    text = render(
        tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    )
    assert text.endswith("y" + family.eos[0]) or ("y" + family.eos[0] + "\n") in text
    stop = read_json(model.out / "generation_config.json")["eos_token_id"]
    stop_ids = stop if isinstance(stop, list) else [stop]
    assert stop_ids == [tokenizer.convert_tokens_to_ids(t) for t in family.eos]
    assert read_json(model.out / "config.json")["eos_token_id"] == stop
    assert tokenizer.bos_token == family.bos
    if family.bos is not None:
        assert text.startswith(family.bos)
        bos_id = tokenizer.convert_tokens_to_ids(family.bos)
        assert read_json(model.out / "generation_config.json")["bos_token_id"] == bos_id


def test_qwen3_like_keeps_reasoning_only_after_the_last_query(
    built: Callable[[str], Built],
) -> None:
    tokenizer = built("qwen3_like").tokenizer
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\none"},
        {"role": "user", "content": "second"},
        *conversation()[2:],
    ]
    text = render(tokenizer, messages, tools=TOOLS)
    assert "old thought" not in text
    assert "<|im_start|>assistant\none<|im_end|>" in text
    # a tool-response turn is not a query: the reasoning of the whole current reply stays
    assert "<think>\nI should use the calculator.\n</think>\n\n<tool_call>" in text
    assert "<think>\nThe tool says 444.\n</think>\n\n444<|im_end|>" in text
    prompt = render(tokenizer, messages[:3], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_llama3_like_always_writes_a_dated_system_header(built: Callable[[str], Built]) -> None:
    tokenizer = built("llama3_like").tokenizer
    messages = [{"role": "user", "content": "hi"}]
    header = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    dated = "Cutting Knowledge Date: December 2023\nToday Date: {}\n\n<|eot_id|>"
    user = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert render(tokenizer, messages) == header + dated.format("26 Jul 2024") + user
    other = render(tokenizer, messages, date_string="01 Jan 2025")
    assert other == header + dated.format("01 Jan 2025") + user


def test_mistral_like_folds_the_system_prompt_into_the_last_user_turn(
    built: Callable[[str], Built],
) -> None:
    tokenizer = built("mistral_like").tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"},
    ]
    text = render(tokenizer, messages, tools=TOOLS)
    assert text.startswith("<s>[INST]first[/INST]one</s>[AVAILABLE_TOOLS][")
    assert text.endswith("[/AVAILABLE_TOOLS][INST]Be brief.\n\nsecond[/INST]")
    assert text.count("Be brief.") == 1
    # no generation prompt: the model answers right after [/INST] or [/TOOL_RESULTS]
    assert render(tokenizer, messages, add_generation_prompt=True) == render(tokenizer, messages)
    after_tool = conversation()[:4]
    assert render(tokenizer, after_tool, add_generation_prompt=True).endswith("[/TOOL_RESULTS]")


def test_r1_like_drops_reasoning_from_assistant_turns(built: Callable[[str], Built]) -> None:
    tokenizer = built("r1_like").tokenizer
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "secret plan\n</think>\n\none"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "two", "reasoning_content": "hidden"},
    ]
    text = render(tokenizer, messages)
    assert "secret" not in text
    assert "hidden" not in text
    assert text == (
        "<｜begin▁of▁sentence｜><｜User｜>first<｜Assistant｜>\n\none<｜end▁of▁sentence｜>"
        "<｜User｜>second<｜Assistant｜>two<｜end▁of▁sentence｜>"
    )
    prompt = render(tokenizer, messages[:3], add_generation_prompt=True)
    assert prompt.endswith("<｜User｜>second<｜Assistant｜><think>\n")


def test_gptoss_like_drops_analysis_from_earlier_turns(built: Callable[[str], Built]) -> None:
    tokenizer = built("gptoss_like").tokenizer
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one", "reasoning_content": "old analysis"},
        {"role": "user", "content": "second"},
        *conversation()[2:],
    ]
    text = render(tokenizer, messages, tools=TOOLS)
    assert "old analysis" not in text
    assert "<|start|>assistant<|channel|>final<|message|>one<|end|>" in text
    # the reply's final answer keeps its analysis; the calls before it lose theirs, as in harmony
    analysis = "<|start|>assistant<|channel|>analysis<|message|>{}<|end|>"
    assert "I should use the calculator." not in text
    assert text.endswith(
        analysis.format("The tool says 444.") + FAMILIES["gptoss_like"].markers[-1]
    )
    # while the reply is still going (no final answer yet), its calls keep their analysis
    prompt = render(tokenizer, messages[:5], tools=TOOLS, add_generation_prompt=True)
    called = "<|start|>assistant to=functions.calculator<|channel|>commentary json<|message|>"
    assert analysis.format("I should use the calculator.") + called in prompt
    assert prompt.endswith("444<|end|><|start|>assistant")
    # with a generation prompt, the last final answer is history and closes with <|end|>
    prompt = render(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
    assert prompt.endswith("final<|message|>444<|end|><|start|>assistant")


def test_control_tokens_come_from_literals_in_order() -> None:
    template = (
        "{{- bos_token -}}{%- for m in messages -%}"
        "{{- '[INST]' + m.content + '[/INST]' if m.role == 'user' else m.content + '</s>' -}}"
        "{{- '<|' + m.role + '|>' -}}{%- endfor -%}<｜x｜> [lower] <tool_call>"
    )
    tokens = template_tokens(template, "t")
    # pieces that build a token ('<|' + role + '|>') are not found; bos_token with no default
    # falls back to <s>
    assert tokens.control == ("[INST]", "[/INST]", "</s>", "<｜x｜>", "<s>")
    assert (tokens.eos, tokens.bos) == (("</s>",), "<s>")


def test_eos_token_variable_is_probed_as_the_default_eos() -> None:
    template = "{%- for m in messages -%}{{- m.content + eos_token -}}{%- endfor -%}"
    assert template_tokens(template, "t").eos == ("</s>",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{{ messages[0].content }", "line 1"),
        ("{{ raise_exception('not for you') }}", "cannot render a probe conversation: not for you"),
        ("{%- for m in messages -%}{{ m.content }}{%- endfor -%}", "no end-of-turn token"),
    ],
)
def test_bad_templates_fail_before_anything_is_written(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.jinja"
    path.write_text(text)
    with pytest.raises(ModelBuildError, match=f"chat template {path}: .*{message}"):
        init_model(tmp_path / "out", chat_template=path)
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("cli_logging")
def test_cli_names_the_bad_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jinja"
    assert (
        main(["init-model", "--out", str(tmp_path / "out"), "--chat-template", str(missing)]) == 2
    )
    err = capsys.readouterr().err
    assert err == f"orchestrate: error: chat template {missing}: No such file or directory\n"
    with pytest.raises(ModelBuildError, match="unknown tool parser 'nope'"):
        init_model(tmp_path / "out", tool_parser="nope")


@pytest.mark.slow
@pytest.mark.usefixtures("cli_logging")
def test_cli_builds_the_cached_model_and_records_the_tool_parser(
    built: Callable[[str], Built], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = TEMPLATES / "llama3_like.jinja"
    out = tmp_path / "llama"
    argv = ["init-model", "--out", str(out), "--chat-template", str(template)]
    assert main([*argv, "--tool-parser", "llama3_json"]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert read_json(out / "sprawl.json") == {"tool_parser": "llama3_json"}
    cached = built("llama3_like").out
    for name in sorted(p.name for p in cached.iterdir()):
        assert (out / name).read_bytes() == (cached / name).read_bytes(), name  # deterministic
    # a rebuild without a parser does not keep the earlier one's
    init_model(out, chat_template=template)
    assert not (out / "sprawl.json").exists()
