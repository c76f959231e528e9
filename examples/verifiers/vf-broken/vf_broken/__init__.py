"""vf-broken: say a word; its reward function has a bug (it raises ``KeyError``). A verifiers
0.4 taskset that shows a failed episode is data: recorded with its error, never a crash."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def echoed(self, trace: vf.Trace) -> float:
        scores = {"yes": 1.0}
        return scores[trace.last_reply]  # the bug: any other reply is a KeyError


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self) -> list[EchoTask]:
        return [
            EchoTask(EchoData(prompt=f"Say {w}.", word=w), self.config.task) for w in ("yes", "no")
        ]


__all__ = ["EchoTaskset"]
