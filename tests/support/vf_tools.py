"""A tool-using multi-turn ``verifiers`` environment written as verifiers users write them: add
two numbers with a tool, then answer; it counts its tool turns in the state (``tool_turns``).
``broken = True`` gives an environment whose code raises once the model has called a tool;
``rewrite = True`` one that rewrites the history (it drops the model's tool-call turns from the
prompt it sends)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

PAIRS = [(2, 3), (17, 25), (40, 2), (9, 9)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class CountingToolEnv(vf.ToolEnv):
    """Keeps its own bookkeeping in the rollout's state, as stateful environments do."""

    async def setup_state(self, state: vf.State) -> vf.State:
        state["grader"] = "exact-match"
        state["tool_turns"] = 0
        return await super().setup_state(state)

    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: object
    ) -> vf.Messages:
        state["tool_turns"] += 1
        return await super().env_response(messages, state, **kwargs)


class BrokenToolEnv(vf.ToolEnv):
    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: object
    ) -> vf.Messages:
        raise RuntimeError("the grader's database is down")


class RewritingToolEnv(vf.ToolEnv):
    async def get_prompt_messages(self, state: vf.State) -> vf.Messages:
        messages = await super().get_prompt_messages(state)
        return [m for m in messages if not (m.role == "assistant" and m.tool_calls)]


def load_environment(
    broken: bool = False, rewrite: bool = False, max_turns: int = 4
) -> vf.Environment:
    dataset = Dataset.from_list(
        [
            {
                "question": f"What is {a} + {b}? Use the add tool, then answer with the number.",
                "answer": str(a + b),
            }
            for a, b in PAIRS
        ]
    )
    parser = vf.Parser()

    def correct(completion: vf.Messages, answer: str) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    rubric = vf.Rubric(funcs=[correct], parser=parser)
    cls = BrokenToolEnv if broken else RewritingToolEnv if rewrite else CountingToolEnv
    return cls(dataset=dataset, tools=[add], rubric=rubric, parser=parser, max_turns=max_turns)
