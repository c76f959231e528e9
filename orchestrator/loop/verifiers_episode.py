"""The episode runner of verifiers 0.4 environments (``environment.kind = "verifiers"``).

The environment plays its own episode (``vf.Env.run_episode``: its agents, their harness
programs, its tool servers and its scoring); this runner is the model behind it. While the run
lasts, :meth:`VerifiersRunner.serving` holds the environment's serving resources
(``Env.serving()``: its interception server, its shared tool servers) and sprawl's
:class:`~orchestrator.loop.verifiers_endpoint.PolicyEndpoint`, which every episode's train
client calls (``TrainClientConfig``: the run's model directory as the renderer's tokenizer, the
environment's ``renderer``). Everything else is :class:`EpisodeRunner`'s: the record, the
whole-episode timeout, the ``Episode`` built at the end.

Guarantees:

- each model call is a segment with its version stamps and bounds, token-exact
  (:mod:`~orchestrator.loop.verifiers_endpoint`); the episode's tokens are the engine's;
- the verifiers episode is stamped as sprawl's: its group (``GroupInfo``: the GRPO group) and
  its run (``TrainRunInfo``: the run's name, the version the group was admitted at, and the
  ``PolicySpan`` from the lowest version stamp of its calls to the highest);
- a failed episode is data: a pool failure is ``model_error``; a refused call of the
  environment's (a re-tokenized history, a second agent), a failed agent, harness, tool server
  or ``Env`` hook are ``env_error`` with verifiers' error type and message; a reward function
  that raised is the episode's reward error; a verifiers deadline is ``episode_timeout``;
  ``environment.max_turns`` and the context limit end the episode as for any environment.

Not covered: ``env.retries`` (a group treats a failed episode as data; an agent's own
``retries`` are run, its discarded attempts leave the episode).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from environments.errors import EnvError
from environments.types import EpisodeState
from environments.verifiers_adapter import OUTCOME_KEY, VerifiersEnvironment
from environments.verifiers_trace import Outcome, tool_calls
from orchestrator.loop.episode import EpisodeRunner, environment_code
from orchestrator.loop.verifiers_endpoint import EpisodeCalls, PolicyEndpoint
from orchestrator.types import StopReason
from policies.wire.lane import VersionBounds
from policies.wire.toolcalls import ToolCall

MODEL_NAME = "sprawl-policy"
"""The ``model`` the environment's calls name (the run's policy answers them)."""


class VerifiersRolloutError(EnvError):
    """What failed a verifiers episode, as verifiers recorded it: ``Type: message``."""


class VerifiersRunner(EpisodeRunner):
    """:class:`EpisodeRunner` whose turns are a verifiers 0.4 environment's episode."""

    env: VerifiersEnvironment

    def __init__(self, *args: Any, run_name: str = "sprawl", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_name = run_name
        self.endpoint = PolicyEndpoint(MODEL_NAME, self.max_context)
        self._ctx: Any = None

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Serve the endpoint and hold the environment's serving resources (module docstring)."""
        import verifiers.v1 as vf

        here = Path(sys.executable).parent  # `uv` of the verifiers extra, for the harnesses
        if shutil.which("uv") is None and (here / "uv").is_file():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
        async with self.endpoint.serve() as url:
            client = vf.TrainClientConfig(
                base_url=f"{url}/v1",
                api_key_var=self.endpoint.key_var,
                renderer=self.env.renderer,
                renderer_model_name=str(self.chat.tokenizer.name_or_path),
            )
            sampling = vf.Sampling(
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                max_tokens=self.sampling.max_tokens,
            )
            self._ctx = vf.ModelContext(model=MODEL_NAME, client=client, sampling=sampling)
            async with self.env.vf.serving():
                yield

    async def _turns(
        self,
        task: dict[str, Any],
        state: EpisodeState,
        rec: dict[str, Any],
        bounds: Callable[[], VersionBounds],
        seed: int | None,
    ) -> StopReason:
        if self._ctx is None:
            raise RuntimeError("VerifiersRunner.serving() is not open")
        calls = EpisodeCalls(rec, bounds, seed, self.max_turns, self._call)
        with environment_code(), self.endpoint.expecting(calls) as on_trace:
            vf_task = self.env.task(task)
            episode = await self.env.vf.run_episode(
                vf_task, self._ctx, on_trace=on_trace, on_discard=calls.discard
            )
        self._stamp(episode, rec)
        outcome = Outcome.of(episode)
        state.data[OUTCOME_KEY] = outcome
        state.messages = outcome.messages()
        if outcome.trace is not None:
            state.tool_results = [
                (ToolCall(id="", name=name, arguments=args), result, None)
                for name, args, result in tool_calls(outcome.trace)
            ]
        if calls.failure is not None:
            raise calls.failure
        if calls.stop is not None:
            return calls.stop
        with environment_code():
            if calls.refused is not None:
                raise VerifiersRolloutError(calls.refused)
            failure = outcome.failure
            if failure is not None and not outcome.timed_out:
                raise VerifiersRolloutError(failure)
        return "episode_timeout" if outcome.timed_out else "done"

    def _stamp(self, episode: Any, rec: dict[str, Any]) -> None:
        """The episode's group, run and policy span, as sprawl recorded them."""
        import verifiers.v1 as vf

        segments = rec["segments"]
        span = None
        if segments:
            span = vf.PolicySpan(
                start=min(s.policy_version.start for s in segments),
                end=max(s.policy_version.end for s in segments),
            )
        episode.env.name = self.name
        episode.group = vf.GroupInfo(id=rec["group_id"])
        work = vf.TrainWorkInfo(step=rec["admitted_at_version"], policy=span)
        episode.record_run(vf.TrainRunInfo(id=self.run_name, work=work))

    def _history_rewritten(self, state: EpisodeState) -> bool:
        """Never: a call whose prompt re-tokenizes the history is refused."""
        return False
