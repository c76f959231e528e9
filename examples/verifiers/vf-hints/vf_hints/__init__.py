"""vf-hints: guess the secret word; after a wrong guess the user gives a hint and the agent
guesses again. A verifiers 0.4 environment with its own ``vf.Env``: ``run`` holds the agent's
rollout open turn by turn (``agent.interaction``), so every episode has two model turns unless
the first guess is right. Nothing in it knows about sprawl.

Reward: ``guessed`` (1 if the last reply is the word).
"""

import verifiers.v1 as vf

WORDS = ["amber", "basil", "cedar", "delta"]


class SecretData(vf.TaskData):
    answer: str


class SecretTask(vf.Task[SecretData]):
    @vf.reward(weight=1.0)
    async def guessed(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class SecretTaskset(vf.Taskset[SecretTask, vf.TasksetConfig]):
    def load(self) -> list[SecretTask]:
        prompt = "Guess the secret word: one lowercase word, nothing else."
        return [SecretTask(SecretData(prompt=prompt, answer=w), self.config.task) for w in WORDS]


class HintsConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class HintsEnv(vf.Env[HintsConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        answer = task.data.answer
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated and first.last_reply != answer:
                await chat.turn(f"No. Hint: it starts with {answer[0]!r}. Guess again.")


__all__ = ["HintsEnv", "SecretTaskset"]
