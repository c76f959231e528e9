"""vf-reverse: reverse a word, in one turn. A verifiers 0.4 taskset written as its users write
them (``import verifiers.v1 as vf``); nothing in it knows about sprawl.

Rewards: ``exact`` (1 if the reply is the reversed word) and ``overlap`` (the share of positions
that match), weighted 1 and 0.5.
"""

import verifiers.v1 as vf

WORDS = ["harbour", "lantern", "puffin", "meadow", "copper", "violet", "thistle", "ember"]


class ReverseData(vf.TaskData):
    answer: str
    """The word, reversed."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def overlap(self, trace: vf.Trace) -> float:
        said, answer = trace.last_reply, self.data.answer
        return sum(a == b for a, b in zip(said, answer, strict=False)) / len(answer)


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 4
    """How many of the words to ask about."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        return [
            ReverseTask(
                ReverseData(prompt=f"Reverse the word: {w}", answer=w[::-1]), self.config.task
            )
            for w in WORDS[: self.config.num_tasks]
        ]


__all__ = ["ReverseTaskset"]
