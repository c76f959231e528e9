"""vf-tools: add two numbers with the ``calc_add`` tool, then answer. A verifiers 0.4 taskset
with a tool server (a ``vf.Toolset``, served over MCP to the agent's program); nothing in it
knows about sprawl.

Reward: ``correct`` (1 if the last reply is the sum). Metric: ``tool_calls`` (the tool results the
agent got back).
"""

import verifiers.v1 as vf

from vf_tools.server import AddToolset, AddToolsetConfig

PAIRS = [(12, 30), (7, 8), (21, 21), (40, 2)]


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData]):
    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 3

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class AddConfig(vf.TasksetConfig):
    tools: AddToolsetConfig = AddToolsetConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    @classmethod
    def toolsets(cls, config: AddConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    def load(self) -> list[AddTask]:
        return [
            AddTask(
                AddData(
                    prompt=f"Use the calc_add tool to add {a} and {b}, then reply with the sum.",
                    answer=str(a + b),
                ),
                self.config.task,
            )
            for a, b in PAIRS
        ]


__all__ = ["AddTaskset"]
