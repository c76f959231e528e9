"""Quantized served views end to end: the trainer publishes fp8_block / int4_group / nvfp4 with
its scale policy, a sidecar + reference engine follows the board bit-exactly w.r.t. the
quantized view, and other engine kinds refuse such a board."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from orchestrator.cli import main as orchestrate
from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from policies.board import Board
from policies.codec.views import ViewKind, ViewSpec, build_view, dequantize
from policies.errors import EngineError
from policies.serve.backends.reference import ReferenceBackend
from policies.serve.backends.shadow import Shadow
from policies.serve.engine import Engine
from policies.serve.sidecar import Sidecar
from policies.train.config import TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer, view_spec
from policies.wire.lane import GenerateRequest
from staleness.config import StalenessConfig
from tests.support.boards import engine as board_engine

VIEWS: list[ViewKind] = ["fp8_block", "int4_group", "nvfp4"]
PROJ = "model.layers.0.mlp.down_proj"
GROUP = 2


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model's tokenizer on a model of hidden size 128, so that int4's 128-wide groups
    quantize every projection (the tiny model's 64 quantizes none)."""
    out = tmp_path_factory.mktemp("wide")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 128, 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(out)
    return out


def _trainer(model_dir: Path, board: Board, **kw: object) -> Trainer:
    return Trainer(
        model_dir,
        board,
        TrainerConfig.model_validate({"lr": 1e-3, "checkpoint": False, **kw}),
        staleness=StalenessConfig(),
        temperature=1.0,
        group_size=GROUP,
    )


def _samples(seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(2 * GROUP):
        ids = [rng.randrange(10, 2000) for _ in range(10)]
        mask = [False] * 4 + [True] * 6
        behav = [0.0] * 4 + [-7.0] * 6
        out.append(
            TrainSample(token_ids=ids, mask=mask, behaviour_logprobs=behav, reward=float(i % 2))
        )
    return out


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trainer's weights, the tied lm_head left out (the embedding serves it)."""
    return {k: v for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"}


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def test_config_names_the_key_of_a_bad_view_or_policy() -> None:
    with pytest.raises(ValidationError, match="served_view"):
        TrainerConfig.model_validate({"served_view": "int8"})
    with pytest.raises(ValidationError, match="scale_policy"):
        TrainerConfig.model_validate({"served_view": "nvfp4", "scale_policy": "sometimes"})
    with pytest.raises(ValidationError, match="served_dtype: renamed to served_view"):
        TrainerConfig.model_validate({"served_dtype": "bfloat16"})
    with pytest.raises(ValidationError, match="scale_policy applies to quantized served views"):
        TrainerConfig.model_validate({"served_view": "float32", "scale_policy": "fresh"})
    assert view_spec(TrainerConfig.model_validate({"served_view": "int4_group"})) == ViewSpec(
        kind="int4_group", scale_policy="pow2"
    )
    assert view_spec(TrainerConfig.model_validate({"served_view": "float16"})) is None
    for given in ({}, {"served_view": "nvfp4", "scale_policy": "fresh"}):
        config = TrainerConfig.model_validate(given)
        assert TrainerConfig.model_validate(config.model_dump()) == config  # the run header's copy
    with pytest.raises(ConfigError, match=r"fleet.islands\[0\] \(kind 'vllm'\)") as err:
        load_config(None, {"trainer.served_view": "fp8_block", "fleet.islands": [{"kind": "vllm"}]})
    assert "trainer.served_view = 'fp8_block'" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("kind", VIEWS)
def test_trainer_publishes_the_quantized_view(
    tmp_path: Path, wide_model_dir: Path, kind: ViewKind
) -> None:
    board = Board(str(tmp_path / "b"), "r")
    trainer = _trainer(wide_model_dir, board, served_view=kind)
    trainer.ensure_published()
    trainer.step(_samples(0))
    manifest = board.manifest(1)
    assert manifest.view == kind
    dtypes = {name: e.dtype for name, e in manifest.tensors.items() if name.startswith(PROJ)}
    assert dtypes == {
        "fp8_block": {f"{PROJ}.weight": "float8_e4m3fn", f"{PROJ}.weight_scale_inv": "float32"},
        "int4_group": {f"{PROJ}.weight_packed": "uint8", f"{PROJ}.weight_scale": "bfloat16",
                       f"{PROJ}.weight_shape": "int64"},
        "nvfp4": {f"{PROJ}.weight": "uint8", f"{PROJ}.weight_scale": "float8_e4m3fn",
                  f"{PROJ}.weight_scale_2": "float32"},
    }[kind]  # fmt: skip
    assert manifest.tensors["model.norm.weight"].dtype == "bfloat16"
    assert "lm_head.weight" not in manifest.tensors  # tied to the embedding: shipped once
    _, view = board.load(1)
    expected = build_view(_state(trainer), ViewSpec(kind=kind, scale_policy="pow2"))
    assert view.keys() == expected.keys()
    for name in view:
        assert _bits(view[name]) == _bits(expected[name]), name
    scale = view[f"{PROJ}.weight_scale_inv" if kind == "fp8_block" else f"{PROJ}.weight_scale"]
    s = scale.float()[scale.float() > 0]
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # the default policy: pow2


@pytest.mark.slow
def test_fixed_scales_are_recomputed_exactly_at_the_anchors_the_board_must_write(
    tmp_path: Path, wide_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "b"), "r", anchor_every=2)
    trainer = _trainer(
        wide_model_dir, board, served_view="fp8_block", scale_policy="fixed_between_anchors"
    )
    trainer.ensure_published()
    for v in range(1, 5):
        trainer.step(_samples(v))
    key = f"{PROJ}.weight_scale_inv"
    scales = {v: board.load(v)[1][key] for v in range(5)}
    kinds = [board.manifest(v).kind for v in range(5)]
    assert kinds == ["anchor", "delta", "anchor", "delta", "anchor"]
    for v in (1, 3):  # a delta keeps the anchor's scales
        assert _bits(scales[v]) == _bits(scales[v - 1])
    assert _bits(scales[2]) != _bits(scales[0])  # an anchor recomputes them from its weights
    fresh = build_view(_state(trainer), ViewSpec(kind="fp8_block"))[key]
    assert _bits(scales[4]) == _bits(fresh)


def _follow(board: Board, model_dir: Path) -> tuple[Engine, Sidecar]:
    """A reference engine (fp32) and its sidecar on ``board``, reconciled by the test."""
    model_dir.mkdir()
    for name, data in board.base_files().items():
        (model_dir / name).write_bytes(data)
    engine = Engine(model_dir, dtype=torch.float32)
    sidecar = Sidecar(
        ReferenceBackend(engine), board, poll_interval_s=3600, registry=CollectorRegistry()
    )
    return engine, sidecar


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "policy"),
    [("fp8_block", "pow2"), ("int4_group", "fresh"), ("nvfp4", "fixed_between_anchors")],
)
@pytest.mark.anyio
async def test_reference_engine_follows_a_quantized_board_bit_exactly(
    tmp_path: Path, wide_model_dir: Path, kind: ViewKind, policy: str
) -> None:
    board = Board(str(tmp_path / "b"), "r", anchor_every=3)
    trainer = _trainer(wide_model_dir, board, served_view=kind, scale_policy=policy)
    trainer.ensure_published()
    engine, sidecar = _follow(board, tmp_path / "engine")
    try:
        for v in range(5):
            if v:
                trainer.step(_samples(v))
            await sidecar.reconcile()
            assert sidecar.applied_version == v
            expected = dequantize(board.load(v)[1], ViewSpec(kind=kind))
            live = engine.live_tensors()
            assert live.keys() <= expected.keys()
            for name, t in live.items():
                assert _bits(t) == _bits(expected[name]), (v, name)
        assert {board.manifest(v).kind for v in range(5)} == {"anchor", "delta"}
        choice = engine.generate(
            GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=6, n=2, seed=1)
        )[0]
        assert 1 <= len(choice.token_ids) == len(choice.logprobs)
        assert all(-30 < lp <= 0 for lp in choice.logprobs)
    finally:
        engine.close()


@pytest.mark.anyio
async def test_a_change_of_scales_alone_recomputes_the_weight(
    tmp_path: Path, wide_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "b"), "r")
    board.create(wide_model_dir)
    model = AutoModelForCausalLM.from_pretrained(wide_model_dir)
    spec = ViewSpec(kind="int4_group")
    v0 = build_view({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, spec)
    board.publish(0, v0, view_name="int4_group")
    engine, sidecar = _follow(board, tmp_path / "engine")
    try:
        await sidecar.reconcile()
        v1 = dict(v0)
        v1[f"{PROJ}.weight_scale"] = v0[f"{PROJ}.weight_scale"] * 2  # codes unchanged
        board.publish(1, v1, view_name="int4_group")
        await sidecar.reconcile()
        assert sidecar.applied_version == 1
        live = engine.live_tensors()[f"{PROJ}.weight"]
        assert _bits(live) == _bits(dequantize(v1, spec)[f"{PROJ}.weight"])
        assert _bits(live) != _bits(dequantize(v0, spec)[f"{PROJ}.weight"])
    finally:
        engine.close()


@pytest.mark.anyio
async def test_orchestrate_engine_serves_a_quantized_board(
    tmp_path: Path, wide_model_dir: Path
) -> None:
    board = Board(str(tmp_path / "b"), "r")
    _trainer(wide_model_dir, board, served_view="nvfp4").ensure_published()
    body = {"prompt_token_ids": [1, 2, 3], "max_tokens": 5, "seed": 3}
    async with (
        board_engine(board) as url,
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/generate", json=body) as r,
    ):
        assert r.status == 200
        choice = (await r.json())["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]) >= 1


@pytest.mark.usefixtures("cli_logging")
def test_other_engine_kinds_refuse_a_quantized_board(
    tmp_path: Path, wide_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    board = Board(str(tmp_path / "b"), "r")
    _trainer(wide_model_dir, board, served_view="int4_group").ensure_published()
    with pytest.raises(EngineError, match=r"int4_group view \(trainer.served_view\); the vllm"):
        Shadow("vllm").stage(board, 0)
    assert Shadow("reference").stage(board, 0).manifest.view == "int4_group"
    args = ["sidecar", "--engine-kind", "sglang", "--engine-url", "http://127.0.0.1:9"]
    assert orchestrate([*args, "--board", board.url, "--run", board.run]) == 2
    err = capsys.readouterr().err
    assert "the sglang engine cannot serve quantized views" in err
    assert "Traceback" not in err
