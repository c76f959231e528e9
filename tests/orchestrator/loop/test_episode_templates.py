"""Multi-turn episodes on the chat templates of the families users train
(``examples/chat_templates/``): the guess game (user turns) and retrieval (tool calls in each
family's dialect, a malformed one included) through the real episode runner, with scripted model
turns that end on the template's own end-of-turn token.

For every template: no ``env_error``; each call's prompt is exactly the previous prompt, the
tokens sampled and the environment's tokens (what the engine saw is what the log holds); the
loss mask covers exactly the sampled tokens; the environment's words reach the model; and
``history_rewritten`` says whether the template would re-render earlier reasoning away.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from environments.guess import Guess, GuessConfig
from environments.retrieval import Retrieval, RetrievalConfig
from orchestrator.record.trajlog import loss_mask
from orchestrator.types import Episode
from policies.wire.tool_parsers import detect_tool_parser
from tests.support.fakes import ScriptedPool, run_scripted
from tests.support.models import model_copy

pytestmark = pytest.mark.anyio
TEMPLATES = Path(__file__).resolve().parents[3] / "examples" / "chat_templates"


def _hermes(name: str, args: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _llama(name: str, args: dict[str, str]) -> str:
    return json.dumps({"name": name, "parameters": args})


def _mistral(name: str, args: dict[str, str]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}])


def _harmony(name: str, args: dict[str, str]) -> str:
    header = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
    return header + json.dumps(args)


Call = Callable[[str, dict[str, str]], str]
# template -> (its tool-call syntax, the parser a run detects, how the model shows reasoning)
FAMILIES: dict[str, tuple[Call, str, Callable[[str, str], str] | None]] = {
    "qwen3_like": (_hermes, "hermes", lambda r, a: f"{r}\n</think>\n\n{a}"),
    "llama3_like": (_llama, "llama3_json", None),
    "mistral_like": (_mistral, "mistral", None),
    "r1_like": (_hermes, "hermes", lambda r, a: f"{r}\n</think>\n\n{a}"),
    "gptoss_like": (
        _harmony,
        "openai",
        lambda r, a: (
            f"<|channel|>analysis<|message|>{r}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{a}"
        ),
    ),
}
# the user turn after an assistant turn with reasoning re-renders it away in these
DROPS_REASONING_AFTER_USER = {"qwen3_like", "r1_like", "gptoss_like"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, PreTrainedTokenizerBase]:
    name = str(request.param)
    out = model_copy(
        "tiny", tmp_path_factory.mktemp(name) / "m", chat_template=TEMPLATES / f"{name}.jinja"
    )
    return name, AutoTokenizer.from_pretrained(out)


def _token_exact(episode: Episode, pool: ScriptedPool) -> None:
    assert episode.error is None, episode.error
    assert len(pool.requests) == len(episode.segments)
    for k, (req, sampled) in enumerate(zip(pool.requests, pool.sampled, strict=True)):
        assert req.prompt_token_ids == episode.token_ids[: len(req.prompt_token_ids)]
        seg = episode.segments[k]
        assert (seg.prompt_len, seg.token_ids) == (len(req.prompt_token_ids), sampled)
        if k + 1 < len(pool.requests):  # the next prompt extends this one by what was sampled
            nxt = pool.requests[k + 1].prompt_token_ids
            assert nxt[: len(req.prompt_token_ids) + len(sampled)] == req.prompt_token_ids + sampled
    mask = loss_mask(episode)
    assert sum(mask) == sum(len(s) for s in pool.sampled)
    for seg in episode.segments:
        assert mask[seg.prompt_len : seg.prompt_len + len(seg.token_ids)] == [1] * len(
            seg.token_ids
        )


def _env_text(pool: ScriptedPool, tokenizer: PreTrainedTokenizerBase, k: int) -> str:
    """What the environment added between call ``k`` and call ``k + 1``."""
    start = len(pool.requests[k].prompt_token_ids) + len(pool.sampled[k])
    return str(tokenizer.decode(pool.requests[k + 1].prompt_token_ids[start:]))


async def test_guess_with_user_turns(family: tuple[str, PreTrainedTokenizerBase]) -> None:
    name, tokenizer = family
    _, parser, think = FAMILIES[name]
    first = think("It is 1 to 100, so halve it.", "50") if think else "50"
    episode, pool = await run_scripted(
        Guess(GuessConfig()),
        tokenizer,
        {"id": "g", "secret": 37},
        [first, "25", "37"],
        parser=parser,
    )
    assert episode.stop_reason == "done"
    _token_exact(episode, pool)
    assert "lower" in _env_text(pool, tokenizer, 0)
    assert "higher" in _env_text(pool, tokenizer, 1)
    assert episode.rewards["solved"] == 1.0
    if think:
        assert episode.messages[1]["reasoning_content"] == "It is 1 to 100, so halve it."
        assert episode.messages[1]["content"] == "50"
    assert episode.history_rewritten == (name in DROPS_REASONING_AFTER_USER)


async def test_retrieval_with_tool_calls_in_the_familys_dialect(
    family: tuple[str, PreTrainedTokenizerBase],
) -> None:
    name, tokenizer = family
    call, parser, _ = FAMILIES[name]
    assert detect_tool_parser(tokenizer.chat_template) == parser  # what a run would pick
    env = Retrieval(RetrievalConfig())
    task = next(t for t in env.tasks() if t["id"] == "q17")
    malformed = call("read", {"doc_id": "d25"}).replace("}", "", 1)  # broken JSON
    texts = [malformed, call("read", {"doc_id": "d25"}), "21 members."]
    episode, pool = await run_scripted(env, tokenizer, task, texts, parser=parser)
    assert episode.stop_reason == "done"
    _token_exact(episode, pool)
    assert [(c.name, c.error) for c in episode.tool_calls] == [("read", None)]
    assert "error:" in _env_text(pool, tokenizer, 0)  # the malformed call is answered, as data
    assert "Vellmar" in _env_text(pool, tokenizer, 1) or "members" in _env_text(pool, tokenizer, 1)
    assert episode.rewards == {"correct": 1.0, "read_source": 1.0}
