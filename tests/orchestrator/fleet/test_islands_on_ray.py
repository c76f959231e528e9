"""Islands as Ray actors on a real Ray cluster (a head node on loopback, 2 CPUs).

Shows: an island placed by its resources serves the run's board with its own bearer token; a
killed actor is seen as down at once and leaves no engine behind; an island pulls a board on S3
with the credentials of the process that placed it, which appear in none of Ray's files or the
island's logs; a vLLM island on Ray serves and takes a version as a patch, and goes with its
actor; an island of a LoRA run serves its adapter versions on the base model, each request at the
version its bounds ask for; an island whose resources no node has fails with the resources named.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anyio
import boto3  # type: ignore[import-untyped]
import pytest

from orchestrator.config import RayFleetConfig, RayResourcesConfig, VLLMIslandConfig
from orchestrator.errors import FleetError
from orchestrator.fleet.islands import LoraServing
from orchestrator.fleet.ray_cluster import RayHead, ray_head
from orchestrator.fleet.ray_launch import connect, launcher
from policies.board import Board
from policies.train.config import LoraConfig, TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from staleness.config import NoCorrection, StalenessConfig
from tests.support.boards import publish_scaled, tiny_board
from tests.support.models import model_copy
from tests.support.s3 import SECRET, moto_server, s3_options
from tests.support.waiting import until

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    with ray_head(tmp_path_factory.mktemp("ray")) as head:
        yield head
    ray.shutdown()


async def _policy(url: str, token: str | None) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/policy", headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def _until_applied(url: str, token: str | None, version: int) -> None:
    async def applied() -> bool:
        return (await _policy(url, token))[1]["applied_version"] == version

    await until(applied, f"{url} serving version {version}", timeout_s=180, every_s=0.5)


async def _until_gone(url: str, token: str | None, timeout_s: float) -> None:
    """Until ``url`` refuses connections (its engine went with its actor)."""

    async def gone() -> bool:
        try:
            await _policy(url, token)
        except aiohttp.ClientError:
            return True
        return False

    await until(gone, f"{url} gone", timeout_s=timeout_s, every_s=0.5)


async def test_an_island_serves_the_board_and_a_killed_actor_is_down(
    cluster: RayHead, tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = tiny_board(tmp_path, tiny_model_dir)
    fleet = RayFleetConfig(address=cluster.address, work_dir=str(tmp_path / "islands"))
    connect(fleet, "run")
    launch = launcher(
        fleet, "ray-0", board_url=board.url, run="run", device="cpu", poll_interval_s=0.2
    )
    island = await launch()
    assert island.ref.id == "ray-0"
    assert island.ref.token
    status, policy = await _policy(island.ref.url, island.ref.token)
    assert (status, policy["applied_version"]) == (200, 0)
    assert (await _policy(island.ref.url, None))[0] == 401  # its own token guards it
    with anyio.move_on_after(3) as healthy:
        await island.down()
    assert healthy.cancelled_caught  # a serving island is not down

    await anyio.to_thread.run_sync(ray.kill, island.actor)
    with anyio.fail_after(20):
        down = await island.down()
    assert "ray-0: its actor died" in down.reason
    await _until_gone(island.ref.url, island.ref.token, timeout_s=30)


async def test_resources_no_node_has_are_named(cluster: RayHead, tmp_path: Path) -> None:
    fleet = RayFleetConfig(
        address=cluster.address,
        work_dir=str(tmp_path / "islands"),
        startup_timeout_s=5,
        resources=RayResourcesConfig(custom={"region:mars": 1}),
    )
    connect(fleet, "run")
    launch = launcher(
        fleet, "ray-9", board_url=str(tmp_path), run="run", device="cpu", poll_interval_s=0.2
    )
    with pytest.raises(
        FleetError, match=r"ray-9 was not serving after 5.0s.*region:mars.*fleet\.ray\.resources"
    ):
        await launch()


async def test_an_island_pulls_an_s3_board_and_its_credentials_appear_nowhere(
    cluster: RayHead, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with moto_server() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        options = s3_options(endpoint)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="islands-bucket"
        )
        board = Board("s3://islands-bucket/boards", "run", storage_options=options)
        board.create(tiny_model_dir)
        publish_scaled(board, 0, tiny_model_dir)
        fleet = RayFleetConfig(address=cluster.address, work_dir=str(tmp_path / "islands"))
        connect(fleet, "run")
        launch = launcher(
            fleet, "ray-s3", board_url=board.url, run="run", device="cpu", poll_interval_s=0.2
        )
        island = await launch()
        status, policy = await _policy(island.ref.url, island.ref.token)
        assert (status, policy["applied_version"]) == (200, 0)
        await island.stop()
    files = [*cluster.temp_dir.rglob("*"), *(tmp_path / "islands").rglob("*")]
    logs = [f for f in files if f.is_file() and f.stat().st_size < 64 << 20]
    assert any(f.suffix in {".log", ".out", ".err"} for f in logs)
    leaked = [str(f) for f in logs if SECRET.encode() in f.read_bytes()]
    assert leaked == []


async def test_a_vllm_island_on_ray_serves_takes_a_patch_and_goes_with_its_actor(
    cluster: RayHead, tmp_path: Path
) -> None:
    small = model_copy("small", tmp_path / "small")  # vLLM's CPU attention: head_dim >= 32
    board = Board(str(tmp_path / "board"), "run")
    board.create(small)
    publish_scaled(board, 0, small)
    fleet = RayFleetConfig(
        address=cluster.address,
        work_dir=str(tmp_path / "islands"),
        engine=VLLMIslandConfig(kind="vllm", max_model_len=512),
        startup_timeout_s=600,
    )
    connect(fleet, "run")
    launch = launcher(
        fleet, "ray-vllm", board_url=board.url, run="run", device="cpu", poll_interval_s=0.2
    )
    island = await launch()
    url, token = island.ref.url, island.ref.token
    await _until_applied(url, token, 0)  # the sidecar takes version 0 into its shadow first
    headers = {"Authorization": f"Bearer {token}"}
    body = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 1.0}
    async with (
        aiohttp.ClientSession(headers=headers) as s,
        s.post(f"{url}/v1/generate", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert answer["policy_version"] == {"start": 0, "end": 0}
    assert len(answer["choices"][0]["token_ids"]) == len(answer["choices"][0]["logprobs"]) > 0
    publish_scaled(board, 1, small, scale=0.5)
    await _until_applied(url, token, 1)
    await anyio.to_thread.run_sync(ray.kill, island.actor)
    await _until_gone(url, token, timeout_s=60)  # the sidecar and vLLM went with their actor


async def test_an_island_of_a_lora_run_on_ray_serves_each_adapter_version_on_the_base_model(
    cluster: RayHead, tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "board"), "run")
    config = TrainerConfig(
        lr=2e-2, served_view="float32", checkpoint=False, lora=LoraConfig(rank=4)
    )
    staleness = StalenessConfig(correction=NoCorrection())
    trainer = Trainer(
        tiny_model_dir, board, config, staleness=staleness, temperature=1.0, group_size=2
    )
    trainer.publish()  # version 0: the adapter, not the model
    fleet = RayFleetConfig(address=cluster.address, work_dir=str(tmp_path / "islands"))
    connect(fleet, "run")
    lora = LoraServing(base_model=tiny_model_dir, max_adapters=2, rank=4)
    launch = launcher(
        fleet, "ray-lora", board_url=board.url, run="run", device="cpu", poll_interval_s=0.2,
        lora=lora,
    )  # fmt: skip
    island = await launch()
    url, token = island.ref.url, island.ref.token
    await _until_applied(url, token, 0)
    samples = [
        TrainSample([5 + i, 9, 11, 40, 7, 3], [False, False, True, True, True, True],
                    [0.0, 0.0, -7.0, -7.0, -7.0, -7.0], reward=float(i % 2))
        for i in range(4)
    ]  # fmt: skip
    await anyio.to_thread.run_sync(trainer.step, samples)
    await _until_applied(url, token, 1)
    answers = {}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        for version in (0, 1):
            body = {
                "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "seed": 3,
                "policy_version": {"min": version, "max": version},
            }  # fmt: skip
            async with s.post(f"{url}/v1/generate", json=body) as r:
                assert r.status == 200, await r.text()
                answers[version] = await r.json()
    await anyio.to_thread.run_sync(ray.kill, island.actor)
    assert [answers[v]["policy_version"] for v in (0, 1)] == [
        {"start": 0, "end": 0},
        {"start": 1, "end": 1},
    ]
    first, second = (answers[v]["choices"][0] for v in (0, 1))
    # both adapters resident on the one base model; the trained one computes otherwise
    assert first["logprobs"] != second["logprobs"]
