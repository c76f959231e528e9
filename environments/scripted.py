"""Play an environment with a scripted policy: a fixed list of assistant texts, no model.

For testing environments. :func:`play` drives the same hooks, in the same order, as the episode
runner (``initial_messages``, then per assistant text ``parse_assistant`` → ``respond``, then
``score``), and sets ``stop_reason`` the same way (``done`` when the environment ended the
episode, ``max_turns`` when the script ran out first). It works on messages only; token
bookkeeping is the runner's job (``orchestrator.loop.episode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from environments.base import Environment
from environments.types import EpisodeState, Reply
from policies.wire.toolcalls import parse_assistant, to_openai_message


@dataclass(frozen=True)
class Played:
    """The outcome of a scripted episode."""

    state: EpisodeState
    replies: list[Reply]
    rewards: dict[str, float]
    reward: float


async def play(env: Environment, task: dict[str, Any], texts: Sequence[str]) -> Played:
    """Run ``texts`` as the assistant's turns of an episode of ``task`` and score it."""
    state = EpisodeState(task=task, messages=list(env.initial_messages(task)))
    replies: list[Reply] = []
    state.stop_reason = "max_turns"
    for turn, text in enumerate(texts):
        state.turn = turn
        first_id = sum(len(m.get("tool_calls") or []) for m in state.messages)
        parsed = parse_assistant(text, first_id=first_id)
        state.messages.append(to_openai_message(parsed))
        reply = await env.respond(state, parsed)
        replies.append(reply)
        state.messages.extend(reply.messages)
        if reply.done:
            state.stop_reason = "done"
            break
    rewards = await env.score(state)
    return Played(state, replies, rewards, env.total_reward(rewards))
