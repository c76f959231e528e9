"""The vLLM command line and environment sprawl starts engines with (no engine started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.errors import EngineError
from policies.serve.backends import vllm_launch
from policies.serve.backends.vllm_launch import cpu_binding, vllm_command, vllm_env


def test_tensor_parallel_engines_get_the_flag_and_one_cpu_group_per_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_launch.os, "sched_getaffinity", lambda pid: {4, 0, 1, 2, 3})
    assert cpu_binding(2) == "0,1,2|3,4"
    assert cpu_binding(5) == "0|1|2|3|4"
    with pytest.raises(EngineError, match="6 tensor-parallel ranks need 6 CPUs; 5 allowed"):
        cpu_binding(6)
    argv = vllm_command(tmp_path, tmp_path, name="m", port=1, max_model_len=64)
    assert "--tensor-parallel-size" not in argv
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env()
    argv = vllm_command(
        tmp_path, tmp_path, name="m", port=1, max_model_len=64, tensor_parallel_size=2
    )
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert vllm_env(tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2|3,4"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the operator's own wins
    assert vllm_env(tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
