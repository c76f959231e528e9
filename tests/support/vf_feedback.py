"""A multi-turn ``verifiers`` environment that talks back: the model must say the secret word;
every other answer gets a user turn with a hint, up to ``max_turns`` model turns."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

WORDS = ["puffin", "ferry", "heather", "lantern"]


class Hints(vf.MultiTurnEnv):
    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: object
    ) -> vf.Messages:
        return [vf.UserMessage(content=f"No. Hint: it starts with '{state['answer'][0]}'.")]

    @vf.stop
    async def said_it(self, state: vf.State) -> bool:
        return (
            bool(state["trajectory"])
            and self.parser.parse_answer(state["trajectory"][-1]["completion"]) == state["answer"]
        )


def load_environment(max_turns: int = 3) -> vf.Environment:
    dataset = Dataset.from_list([{"question": "Guess my secret word.", "answer": w} for w in WORDS])
    parser = vf.Parser()

    def said(completion: vf.Messages, answer: str) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    rubric = vf.Rubric(funcs=[said], parser=parser)
    return Hints(dataset=dataset, rubric=rubric, parser=parser, max_turns=max_turns)
