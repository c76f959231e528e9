"""A single-turn ``verifiers`` environment written as verifiers users write them: reverse a
word. ``load_environment`` is what ``environment.kind = "verifiers"`` calls."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

WORDS = ["harbour", "lantern", "puffin", "ferry", "island", "herring", "museum", "heather"]


def load_environment(num_tasks: int = 8, broken_reward: bool = False) -> vf.Environment:
    dataset = Dataset.from_list(
        [
            {
                "question": f"Reverse the word '{w}'. Answer with the reversed word only.",
                "answer": w[::-1],
            }
            for w in WORDS[:num_tasks]
        ]
    )
    parser = vf.Parser()

    def exact(completion: vf.Messages, answer: str) -> float:
        if broken_reward:
            return 1 / 0
        return float((parser.parse_answer(completion) or "").strip() == answer)

    def overlap(completion: vf.Messages, answer: str) -> float:
        said = (parser.parse_answer(completion) or "").strip()
        return sum(a == b for a, b in zip(said, answer, strict=False)) / len(answer)

    rubric = vf.Rubric(funcs=[exact, overlap], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(
        dataset=dataset, system_prompt="You reverse words.", parser=parser, rubric=rubric
    )
