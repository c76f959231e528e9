"""LoRA versions end to end on the tiny model: the reference trainer trains and publishes adapters;
one reference engine (over real HTTP) holds several at once and serves each request the version
its bounds ask for, stamped, with a 409 when no resident adapter fits."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import ConfigError
from policies.board import Board
from policies.errors import AdapterError, BoardError
from policies.serve.adapters import ResidentAdapters, adapter_config, is_adapter_view
from policies.serve.backends.standalone import make_backend
from policies.serve.backends.vllm_lora import VLLMLoraBackend
from policies.train.config import LoraConfig, TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from policies.wire.lane import VersionBounds
from staleness.config import NoCorrection, StalenessConfig
from tests.support.boards import engine
from tests.support.lane import loopback
from tests.support.waiting import until

pytestmark = pytest.mark.anyio
GROUP = 4


def _trainer(model_dir: Path, board: Board, **lora: Any) -> Trainer:
    config = TrainerConfig(
        lr=2e-2, served_view="float32", checkpoint=False, lora=LoraConfig(rank=4, **lora)
    )
    staleness = StalenessConfig(correction=NoCorrection())
    return Trainer(model_dir, board, config, staleness=staleness, temperature=1.0, group_size=GROUP)


def _samples(seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(2 * GROUP):
        ids = [rng.randrange(10, 2000) for _ in range(10)]
        mask = [False] * 4 + [True] * 6
        out.append(TrainSample(ids, mask, [0.0] * 4 + [-7.0] * 6, reward=float(i % 2)))
    return out


def _prompt_logprobs(trainer: Trainer, prompt: list[int], tokens: list[int]) -> list[float]:
    """What the trainer's current weights give each of ``tokens`` after ``prompt``."""
    ids = prompt + tokens
    logp, _ = trainer.logprobs([TrainSample(ids, [True] * len(ids), [0.0] * len(ids), 0.0)])
    return logp[0, len(prompt) - 1 :].tolist()


async def _generate(s: aiohttp.ClientSession, url: str, lo: int | None, hi: int | None) -> Any:
    body = {
        "prompt_token_ids": [5, 6, 7, 8],
        "max_tokens": 6,
        "seed": 3,
        "policy_version": {"min": lo, "max": hi},
    }
    async with s.post(f"{url}/v1/generate", json=body) as r:
        return r.status, await r.json()


async def _activate(s: aiohttp.ClientSession, url: str, version: int) -> None:
    async with s.post(f"{url}/v1/policy/notify", json={}) as r:
        assert r.status == 200

    async def applied() -> bool:
        async with s.get(f"{url}/v1/policy") as r:
            return bool((await r.json())["applied_version"] == version)

    await until(applied, f"version {version} applied", timeout_s=30)


@pytest.mark.slow
def test_a_lora_version_is_the_adapter_and_the_base_stays_frozen(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # The tiny adapter's patches are near half its size (every lora_B value moves on the first
    # step); the fraction is raised so this test sees the layout, not the anchor-size rule.
    board = Board(str(tmp_path / "board"), "lora", anchor_fraction=2.0)
    trainer = _trainer(tiny_model_dir, board)
    trainer.publish()
    trainer.step(_samples(0))
    trainer.step(_samples(1))
    base = load_file(tiny_model_dir / "model.safetensors")
    live = trainer.model.state_dict()
    for name, t in base.items():  # the base weights never move
        module, param = name.rsplit(".", 1)
        key = name if name in live else f"{module}.base_layer.{param}"
        assert torch.equal(live[key], t), name
    first, last = board.load(0)[1], board.load(2)[1]
    assert is_adapter_view(last)
    assert set(first) == set(last)
    assert len(last) == 2 * 4 * 2  # lora_A and lora_B of q, k, v, o in each of 2 layers
    assert adapter_config(last).r == 4
    assert all(not t.any() for n, t in first.items() if "lora_B" in n)  # v0 computes the base
    assert any(t.any() for n, t in last.items() if "lora_B" in n)
    manifests = [board.manifest(v) for v in (0, 1, 2)]
    assert [m.kind for m in manifests[:2]] == ["anchor", "delta"]  # patches between anchors
    assert manifests[0].full_bytes < sum(t.nbytes for t in base.values()) / 10


def test_bad_lora_tables_are_refused_naming_the_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"lora\.rank"):
        TrainerConfig.model_validate({"lora": {"rank": 0}})
    with pytest.raises(ValueError, match=r"lora\.target_modules\n.*'q\.proj' is not a module name"):
        TrainerConfig.model_validate({"lora": {"target_modules": ["q.proj"]}})
    with pytest.raises(ValueError, match="lora: a LoRA version is its adapter"):
        TrainerConfig(lora=LoraConfig(), served_view="int4_group")
    loop = Path("tests/support/loop.toml")
    with pytest.raises(ConfigError, match=r"command line: trainer\.lora\.dropout: .*less than 1"):
        load_config(loop, parse_overrides(["--trainer.lora.dropout", "1.0"]))
    assert load_config(loop, {"trainer.lora.rank": 4}).trainer.lora == LoraConfig(rank=4)
    board = Board(str(tmp_path / "board"), "lora")
    with pytest.raises(AdapterError, match=r"trainer.lora.target_modules: .*\bnope\b"):
        _trainer(tiny_model_dir, board, target_modules=["nope"])


@pytest.mark.slow
async def test_one_engine_serves_each_request_the_adapter_its_bounds_pick(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "board"), "lora")
    trainer = _trainer(tiny_model_dir, board)
    trainer.publish()
    want: dict[int, list[float]] = {}
    async with (
        engine(board, poll_interval_s=3600, base_model=tiny_model_dir, max_adapters=2) as url,
        aiohttp.ClientSession() as s,
    ):
        await _activate(s, url, 0)
        status, v0 = await _generate(s, url, None, 0)
        assert status == 200
        assert v0["policy_version"] == {"start": 0, "end": 0}
        tokens = v0["choices"][0]["token_ids"]
        want[0] = _prompt_logprobs(trainer, [5, 6, 7, 8], tokens)
        assert v0["choices"][0]["logprobs"] == pytest.approx(want[0], abs=1e-4)

        trainer.step(_samples(0))
        await _activate(s, url, 1)
        # both versions resident: requests with different bounds, at the same time, on one engine
        results: dict[int, Any] = {}

        async def ask(version: int) -> None:
            results[version] = await _generate(s, url, version, version)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, 0)
            tg.start_soon(ask, 1)
        assert results[0][0] == 200, results[0]
        # the same adapter: the same tokens; a row batched beside another adapter's may differ
        # from the solo run in the last float bits
        (again,) = results[0][1]["choices"]
        assert again["token_ids"] == v0["choices"][0]["token_ids"]
        assert again["logprobs"] == pytest.approx(v0["choices"][0]["logprobs"], abs=1e-5)
        assert results[0][1]["policy_version"] == {"start": 0, "end": 0}
        status, v1 = results[1]
        assert status == 200
        assert v1["policy_version"] == {"start": 1, "end": 1}
        one = _prompt_logprobs(trainer, [5, 6, 7, 8], v1["choices"][0]["token_ids"])
        assert v1["choices"][0]["logprobs"] == pytest.approx(one, abs=1e-4)
        assert one != pytest.approx(
            _prompt_logprobs_at_base(tiny_model_dir, v1["choices"][0]["token_ids"]), abs=1e-4
        )
        status, newest = await _generate(s, url, None, None)  # no bounds: the newest
        assert newest["policy_version"] == {"start": 1, "end": 1}

        # v0 used after v1: loading v2 evicts v1, the least recently used
        assert (await _generate(s, url, 0, 0))[0] == 200
        trainer.step(_samples(1))
        await _activate(s, url, 2)
        status, conflict = await _generate(s, url, 1, 1)
        assert status == 409
        assert conflict["error"]["type"] == "policy_version_unavailable"
        assert conflict["error"]["applied_version"] == 2
        assert "no resident adapter version (0, 2)" in conflict["error"]["message"]
        status, body = await _generate(s, url, 0, 1)  # v0 still resident: served there
        assert (status, body["policy_version"]) == (200, {"start": 0, "end": 0})
        async with s.get(f"{url}/metrics") as r:
            assert "sprawl_version_conflicts_total 1.0" in await r.text()


def _prompt_logprobs_at_base(model_dir: Path, tokens: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[5, 6, 7, 8, *tokens]])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].log_softmax(-1)
    return [float(logp[i, ids[0, i + 1]]) for i in range(3, ids.shape[1] - 1)]


def _adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A rank-2 adapter view on q_proj of every layer of ``model``, random lora_B."""
    gen = torch.Generator().manual_seed(seed)
    view = {}
    for name, module in model.named_modules():
        if name.endswith("q_proj"):
            assert isinstance(module, torch.nn.Linear)
            view[f"{name}.lora_A.weight"] = torch.randn(2, module.in_features, generator=gen)
            view[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 2, generator=gen)
    return view


def test_the_least_recently_used_adapter_not_in_use_is_evicted(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    resident = ResidentAdapters(model, max_resident=2)
    views = {v: _adapter(model, v) for v in range(4)}
    for v in (0, 1):
        resident.load(v, views[v], adapter_config(views[v]), in_use=())
    assert resident.pick(VersionBounds(max=0)) == 0  # 0 used last: 1 is the LRU
    assert resident.load(2, views[2], adapter_config(views[2]), in_use=()) == [1]
    assert resident.versions() == [0, 2]
    assert resident.pick(VersionBounds(min=1, max=1)) is None
    assert resident.pick(VersionBounds()) == 2  # the newest resident
    assert resident.evictable(in_use={0, 2}) is False
    assert resident.load(3, views[3], adapter_config(views[3]), in_use={2}) == [0]
    assert resident.versions() == [2, 3]


def test_a_view_that_is_not_an_adapter_of_the_model_changes_nothing(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    resident = ResidentAdapters(model, max_resident=2)
    good = _adapter(model, 0)
    resident.load(0, good, adapter_config(good), in_use=())
    half = {k: t for k, t in good.items() if "layers.0." not in k or "lora_A" in k}
    with pytest.raises(AdapterError, match="a lora_A and a lora_B matrix per adapted layer"):
        adapter_config(half)
    elsewhere = {k.replace("q_proj", "up_proj"): t for k, t in good.items()}
    with pytest.raises(AdapterError, match=r"version 1 is not an adapter of this model: .*up_proj"):
        resident.load(1, elsewhere, adapter_config(elsewhere), in_use=())
    wide = {k: torch.zeros(2, t.shape[1] + 1) if "lora_A" in k else t for k, t in good.items()}
    with pytest.raises(AdapterError, match=r"version 2 does not fit this model's layers: .*lora_A"):
        resident.load(2, wide, adapter_config(wide), in_use=())
    assert resident.versions() == [0]
    assert resident.model is not None
    assert set(resident.model.peft_config) == {"v0"}


def test_sidecars_of_other_engine_kinds_refuse_lora_versions(tmp_path: Path) -> None:
    board = Board(str(tmp_path / "board"), "lora")
    for kind in ("sglang", "llamacpp", "openai"):
        with pytest.raises(BoardError, match=f"only vllm serves them, not {kind}"):
            make_backend(
                kind, "http://127.0.0.1:1", board=board, model="m", max_context=64,
                api_key=None, materialize_dir=tmp_path, version=0, tokenizer=None,
                max_adapters=2,
            )  # fmt: skip
    vllm = make_backend(
        "vllm", "http://127.0.0.1:1", board=board, model="m", max_context=64, api_key=None,
        materialize_dir=tmp_path, version=None, tokenizer=None, max_adapters=2,
    )  # fmt: skip
    assert isinstance(vllm, VLLMLoraBackend)
    assert vllm.lru.max_resident == 2


async def test_vllm_lora_adapters_are_evicted_and_loaded_again_after_a_restart(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A scripted vLLM (its LoRA routes' shapes): the backend writes each staged adapter as a
    peft directory, unloads the least recently used beyond the bound, and loads the resident
    ones again when a restarted engine lists none."""
    board = Board(str(tmp_path / "board"), "lora")
    board.create(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for version in range(3):
        board.publish(version, _adapter(model, version), view_name="float32")
    loaded: set[str] = set()
    calls: list[tuple[str, str]] = []

    async def route(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            data = [{"id": n, "object": "model", "max_model_len": 64} for n in ["m", *loaded]]
            return web.json_response({"object": "list", "data": data})
        body = await request.json()
        calls.append((request.path, body["lora_name"]))
        if request.path == "/v1/load_lora_adapter":
            spec = json.loads((Path(body["lora_path"]) / "adapter_config.json").read_text())
            assert (spec["r"], spec["lora_alpha"], spec["target_modules"]) == (2, 2, ["q_proj"])
            loaded.add(body["lora_name"])
        else:
            loaded.discard(body["lora_name"])
        return web.Response(text="Success")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", route)
    async with loopback(app) as url:
        backend = VLLMLoraBackend(
            url, work_dir=tmp_path / "island", max_adapters=2, model="m", max_context=64
        )
        try:
            for version in range(3):
                await backend.stage(board, version)
                await backend.activate(version, "wait")
            assert backend.resident_versions() == [1, 2]
            load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
            assert calls[-2:] == [(load, "v2"), (unload, "v0")]
            assert sorted(p.name for p in (tmp_path / "island").iterdir()) == [
                "lora-00000001",
                "lora-00000002",
            ]
            loaded.clear()  # vLLM restarted on its base weights
            backend.lost = True
            await backend.recover()
            assert loaded == {"v1", "v2"}
        finally:
            await backend.aclose()
