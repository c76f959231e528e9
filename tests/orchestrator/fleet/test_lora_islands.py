"""LoRA versions on the run's own islands: a vLLM island starts vLLM on the base model with
run-time adapters, and the islands that cannot serve adapters are refused at config time.
The live run is ``tests/e2e/test_lora_run.py``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from orchestrator.config import VLLMIslandConfig, load_config
from orchestrator.errors import ConfigError, FleetError
from orchestrator.fleet.children import Children
from orchestrator.fleet.islands import LoraServing, start_island
from policies.serve.backends.vllm_launch import vllm_lora_rank
from policies.train.config import LoraConfig

LOOP = Path("tests/support/loop.toml")


def test_lora_runs_refuse_islands_that_cannot_serve_adapters() -> None:
    lora = {"trainer.lora.rank": 4}
    with pytest.raises(ConfigError, match=r"fleet\.islands\[1\] \(kind 'llamacpp'\) cannot serve"):
        load_config(LOOP, {"fleet.islands": [{"kind": "vllm"}, {"kind": "llamacpp"}], **lora})
    with pytest.raises(ConfigError, match=r"fleet\.ray\.engine \(kind 'llamacpp'\) cannot serve"):
        load_config(LOOP, {"fleet.ray": {"engine": {"kind": "llamacpp"}}, **lora})
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank = 600: .*up to 512"):
        load_config(LOOP, {"fleet.islands": [{"kind": "vllm"}], "trainer.lora.rank": 600})
    with pytest.raises(ConfigError, match=r"fleet\.islands\.0: Input tag 'sglang'"):
        load_config(LOOP, {"fleet.islands": [{"kind": "sglang"}], **lora})
    vllm = {"kind": "vllm"}
    cfg = load_config(LOOP, {"fleet.islands": [vllm], "fleet.ray": {"engine": vllm}, **lora})
    assert cfg.trainer.lora == LoraConfig(rank=4)  # vLLM serves adapters, locally and on Ray
    assert cfg.fleet.ray is not None
    assert load_config(LOOP, {"fleet.ray": {}, **lora}).fleet.ray is not None  # reference engines


def test_the_lora_rank_vllm_is_started_with_covers_the_adapters() -> None:
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]


@pytest.mark.anyio
async def test_a_vllm_island_of_a_lora_run_starts_vllm_on_the_base_model(tmp_path: Path) -> None:
    """The engine command vLLM gets (here a script that records it and exits)."""
    record = tmp_path / "argv.json"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"json.dump([sys.argv[1:], os.environ.get('VLLM_ALLOW_RUNTIME_LORA_UPDATING')],"
        f" open({str(record)!r}, 'w'))\nsys.exit(3)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    base = tmp_path / "base"
    lora = LoraServing(base_model=base, max_adapters=3, rank=4)
    spec = VLLMIslandConfig(kind="vllm", python=fake, max_model_len=256)
    async with Children(tmp_path / "logs") as children:
        with pytest.raises(FleetError, match=r"fleet.islands\[0\] \(vllm\): vLLM exited with 3"):
            await start_island(
                0, spec, children, island_id="vllm-0", board_url=str(tmp_path / "board"),
                run="r", island_dir=tmp_path / "island", poll_interval_s=0.1, lora=lora,
            )  # fmt: skip
    argv, runtime_updating = json.loads(record.read_text())
    assert argv[argv.index("--model") + 1] == str(base)  # not a materialized full version
    assert argv[argv.index("--enable-lora") :] == [
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
    ]  # fmt: skip
    assert runtime_updating == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in os.environ  # only vLLM's environment
    assert not (tmp_path / "island" / "model").exists()
