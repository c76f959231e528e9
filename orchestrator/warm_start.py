"""SFT warm start: teach a fresh model the demo environment's tool-calling format before RL.

A random model almost never writes a well-formed ``<tool_call>`` block, so GRPO on the calculator
has nothing to reinforce. :func:`warm_start` fine-tunes the model in ``model_dir`` on *ideal*
calculator episodes rendered with the tokenizer's own chat template::

    user:       What is 37 * 12? Use the calculator tool, then answer with the number.
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 12"}}
                </tool_call>
    tool:       444                       (the environment's real tool output)
    assistant:  The answer is 444.

Each example is tokenized exactly as the episode runner builds prompts
(:class:`policies.wire.chat_tokens.ChatTokens`: initial prompt, the sampled assistant tokens up to
and including the end-of-turn token, then the continuation), and the loss (cross entropy) applies
only to the assistant tokens. The SFT tasks come from the calculator's generator under a seed
disjoint from the RL run's (``seed + 10_000``), so the warm start does not see the RL tasks.

:func:`format_score` measures what RL starts from: sampled episodes (real reference engine, the
environment's own ``respond`` and rewards, at a given temperature) with at least one tool call
that ran without error, and the mean reward. ``warm_start`` records both, before and after, in
``<model_dir>/sft.json`` and replaces ``model.safetensors`` atomically (temp file + rename).

Guarantees: deterministic for a given ``(model_dir, steps, seed)`` on CPU. Not covered: other
environments' formats (the example renderer is calculator-specific), batching the evaluation.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from environments.base import Environment
from environments.loader import load_environment
from environments.types import EpisodeState
from policies.errors import ModelBuildError
from policies.model.build import init_model
from policies.model.sizes import ModelSize
from policies.serve.engine import Engine
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import GenerateRequest
from policies.wire.toolcalls import Message, ToolCall, parse_assistant, to_openai_message

log = structlog.get_logger(__name__)

CALCULATOR = "environments.calculator:Calculator"
SFT_SEED_OFFSET = 10_000
_EXPRESSION = re.compile(r"-?\d+(?:\s*[-+*/]\s*-?\d+)+")


@dataclass(frozen=True)
class FormatScore:
    """How well sampled episodes follow the environment's format."""

    episodes: int
    valid_tool_call: float  # fraction with ≥ 1 tool call that ran without error
    correct: float  # fraction whose ``correct`` reward component is 1
    reward_mean: float


@dataclass(frozen=True)
class SFTResult:
    steps: int
    examples: int
    first_loss: float
    final_loss: float
    seconds: float
    before: FormatScore | None
    after: FormatScore | None


def calculator_env(num_tasks: int, seed: int, max_operand: int = 99) -> Environment:
    return load_environment(
        CALCULATOR, {"num_tasks": num_tasks, "seed": seed, "max_operand": max_operand}
    )


def _assistant_text(
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]],
    history: list[Message],
    message: Message,
) -> str:
    """What a model writes for ``message`` after ``history``: its text through the end token."""
    tools_any: Any = tools
    before = tokenizer.apply_chat_template(
        history, tools=tools_any, add_generation_prompt=True, tokenize=False
    )
    after = tokenizer.apply_chat_template(
        [*history, message], tools=tools_any, add_generation_prompt=False, tokenize=False
    )
    assert isinstance(before, str)
    assert isinstance(after, str)
    if not after.startswith(before):
        raise ValueError("chat template does not render conversations as stable prefixes")
    text = after[len(before) :]
    eos = str(tokenizer.eos_token)
    return text[: text.index(eos) + len(eos)]


async def ideal_example(
    env: Environment, chat: ChatTokens, task: dict[str, Any]
) -> tuple[list[int], list[bool]]:
    """Token ids of one ideal calculator episode and the mask of its assistant tokens."""
    match = _EXPRESSION.search(str(task["question"]))
    if match is None:
        raise ValueError(f"no arithmetic expression in task question {task['question']!r}")
    tokenizer, tools = chat.tokenizer, env.tool_schemas()
    history = list(env.initial_messages(task))
    ids = chat.initial(history)
    mask = [False] * len(ids)
    arguments = json.dumps({"expression": match.group(0)})
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": arguments},
            }
        ],
    }
    first = chat.encode(_assistant_text(tokenizer, tools, history, call))
    result, error = await env.call_tool(
        ToolCall(id="call_0", name="calculator", arguments=arguments)
    )
    if error is not None:
        raise ValueError(f"calculator refused {arguments}: {error}")
    tool_msg = {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": result}
    history += [call, tool_msg]
    between = chat.continuation(first, [tool_msg])
    answer = {"role": "assistant", "content": f"The answer is {result}."}
    second = chat.encode(_assistant_text(tokenizer, tools, history, answer))
    ids += first + between + second
    mask += [True] * len(first) + [False] * len(between) + [True] * len(second)
    return ids, mask


def _examples(env: Environment, chat: ChatTokens) -> list[tuple[list[int], list[bool]]]:
    async def build() -> list[tuple[list[int], list[bool]]]:
        return [await ideal_example(env, chat, dict(task)) for task in env.tasks()]

    return anyio.run(build)


def _sft_loss(model: Any, batch: list[tuple[list[int], list[bool]]]) -> torch.Tensor:
    width = max(len(ids) for ids, _ in batch)
    ids_t = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros_like(ids_t)
    target = torch.zeros(len(batch), width, dtype=torch.bool)
    for i, (ids, mask) in enumerate(batch):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        target[i, : len(ids)] = torch.tensor(mask)
    logits = model(input_ids=ids_t, attention_mask=attn).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids_t[:, 1:].reshape(-1), reduction="none"
    ).reshape(len(batch), width - 1)
    m = target[:, 1:]
    return (nll * m).sum() / m.sum().clamp(min=1)


def warm_start(
    model_dir: Path,
    *,
    steps: int,
    lr: float = 6e-3,
    batch_size: int = 8,
    num_tasks: int = 512,
    seed: int = 0,
    eval_episodes: int = 32,
    temperature: float = 1.0,
    max_operand: int = 99,
) -> SFTResult:
    """Fine-tune ``model_dir`` in place for ``steps`` steps; measure the format before and after.

    ``max_operand`` is the calculator's difficulty (operands in 2..max_operand): train on the
    distribution the RL run will see."""
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = calculator_env(num_tasks, seed + SFT_SEED_OFFSET, max_operand)
    chat = ChatTokens(tokenizer, env.tool_schemas())
    examples = _examples(env, chat)
    score = functools.partial(
        format_score, model_dir, eval_episodes, temperature, seed, max_operand=max_operand
    )
    before = score() if eval_episodes else None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * max(0.1, 1.0 - i / max(steps, 1))
    )
    rng = random.Random(seed)
    loss_value = first_loss = float("nan")
    for step in range(steps):
        loss = _sft_loss(model, rng.sample(examples, min(batch_size, len(examples))))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if step == 0:
            first_loss = loss_value
        if step % 50 == 0 or step == steps - 1:
            log.info("sft_step", step=step, loss=round(loss_value, 4))
    _save_weights(model, model_dir)
    after = score() if eval_episodes else None
    result = SFTResult(
        steps=steps,
        examples=len(examples),
        first_loss=first_loss,
        final_loss=loss_value,
        seconds=time.perf_counter() - t0,
        before=before,
        after=after,
    )
    (model_dir / "sft.json").write_text(json.dumps(asdict(result), indent=1) + "\n")
    log.info("sft_done", steps=steps, loss=round(loss_value, 4), seconds=round(result.seconds, 1))
    return result


def _save_weights(model: Any, model_dir: Path) -> None:
    staging = model_dir / f".sft-{os.getpid()}"
    model.save_pretrained(staging)
    os.replace(staging / "model.safetensors", model_dir / "model.safetensors")
    for leftover in staging.iterdir():
        leftover.unlink()
    staging.rmdir()


def format_score(
    model_dir: Path,
    episodes: int,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    max_turns: int = 3,
    max_tokens: int = 40,
    max_operand: int = 99,
) -> FormatScore:
    """Sample ``episodes`` calculator episodes from ``model_dir``'s weights and score them."""
    engine = Engine(model_dir, dtype=torch.float32)
    engine.activate(load_file(model_dir / "model.safetensors"), version=0)
    env = calculator_env(episodes, seed + 2 * SFT_SEED_OFFSET, max_operand)
    chat = ChatTokens(engine.tokenizer, env.tool_schemas())

    async def one(index: int, task: dict[str, Any]) -> tuple[bool, float, float]:
        state = EpisodeState(task=task, messages=list(env.initial_messages(task)))
        ids = chat.initial(state.messages)
        for turn in range(max_turns):
            state.turn = turn
            request = GenerateRequest(
                prompt_token_ids=ids,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed * 1_000 + index * max_turns + turn,
            )
            choice = engine.generate(request)[0]
            ids = ids + choice.token_ids
            text = str(engine.tokenizer.decode(choice.token_ids, skip_special_tokens=True))
            parsed = parse_assistant(text, first_id=len(state.tool_results))
            state.messages.append(to_openai_message(parsed))
            reply = await env.respond(state, parsed)
            state.messages.extend(reply.messages)
            if reply.done:
                state.stop_reason = "done"
                break
            ids = ids + chat.continuation(choice.token_ids, reply.messages)
        else:
            state.stop_reason = "max_turns"
        rewards = await env.score(state)
        valid = any(error is None for _, _, error in state.tool_results)
        return valid, env.total_reward(rewards), rewards.get("correct", 0.0)

    async def run_all() -> list[tuple[bool, float, float]]:
        return [await one(i, dict(task)) for i, task in enumerate(env.tasks())]

    rows = anyio.run(run_all)
    n = max(len(rows), 1)
    return FormatScore(
        episodes=len(rows),
        valid_tool_call=sum(v for v, _, _ in rows) / n,
        correct=sum(c for _, _, c in rows) / n,
        reward_mean=sum(r for _, r, _ in rows) / n,
    )


Phase = tuple[int, float, int]
"""One SFT phase of the warm-start recipe: ``(steps, lr, max_operand)``."""


def sft_phases(sft_steps: int, focus_steps: int, max_operand: int) -> list[Phase]:
    """The SFT curriculum as ``(steps, lr, max_operand)`` phases (phases of 0 steps left out).

    ``sft_steps`` on the full operand range (2..99: the format, and copying numbers from the
    question into the call and from the tool's output into the answer), the first 5/9 at lr 6e-3,
    the rest at 4e-3; then ``focus_steps`` at lr 3e-3 on the run's own range (``max_operand``).
    The tiny model learns copying on the full range in ~1800 steps; a direct SFT on single-digit
    operands had not learnt it after 2500 (see docs/benchmarks.md).
    """
    first = math.ceil(sft_steps * 5 / 9)
    phases = [(first, 6e-3, 99), (sft_steps - first, 4e-3, 99), (focus_steps, 3e-3, max_operand)]
    return [p for p in phases if p[0] > 0]


def recorded_phases(model_dir: Path) -> list[Phase] | None:
    """The phases ``model_dir/sft.json`` records (None: no ``sft.json``; [] for the
    single-phase record :func:`warm_start` alone writes)."""
    path = model_dir / "sft.json"
    if not path.exists():
        return None
    recorded = json.loads(path.read_text()).get("phases", [])
    return [(p.get("steps"), p.get("lr"), p.get("max_operand")) for p in recorded]


def warm_model(
    model_dir: Path,
    *,
    size: ModelSize,
    seed: int,
    phases: list[Phase],
    eval_episodes: int = 32,
) -> Path:
    """A model of ``size`` built by :func:`~policies.model.build.init_model` and warm-started by
    ``phases`` (:func:`sft_phases`) in ``model_dir``; reused when it is already there.

    Built in a sibling temp directory and renamed into place when the last phase is done, so a
    directory at ``model_dir`` is always a finished model (a crash leaves only the temp dir,
    removed by the next build). Reused when its ``sft.json`` records the same phases; a model
    at ``model_dir`` built otherwise raises :class:`ModelBuildError` rather than being reused or
    overwritten. Only the last phase scores the model before and after (``eval_episodes``)."""
    if model_dir.exists():
        got = recorded_phases(model_dir)
        if got != phases:
            how = "with SFT phases " + str(got or "of an older recipe")
            if got is None:
                how = "without an SFT warm start"
            raise ModelBuildError(
                f"{model_dir} holds a model built {how}, not the warm start asked for "
                f"({phases}): remove it or choose another model directory"
            )
        log.info("warm_model_reused", path=str(model_dir))
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in model_dir.parent.glob(f".{model_dir.name}.building-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = model_dir.parent / f".{model_dir.name}.building-{os.getpid()}"
    init_model(staging, size, seed=seed)
    done = []
    for i, (steps, lr, operand) in enumerate(phases):
        last = i == len(phases) - 1
        result = warm_start(
            staging,
            steps=steps,
            lr=lr,
            seed=seed,
            max_operand=operand,
            eval_episodes=eval_episodes if last else 0,
        )
        done.append({"max_operand": operand, "lr": lr, **asdict(result)})
    (staging / "sft.json").write_text(json.dumps({"phases": done}, indent=1) + "\n")
    try:
        os.rename(staging, model_dir)
    except OSError:  # another process finished the same model first
        shutil.rmtree(staging, ignore_errors=True)
        if recorded_phases(model_dir) != phases:
            raise
    return model_dir
