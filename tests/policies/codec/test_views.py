"""Served views: layout, quantization against a straightforward reference, scales, and patches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.codec import apply_patch, encode_patch, read_patch_header, state_digest
from policies.codec.views import (
    FP4_VALUES,
    ViewKind,
    ViewSpec,
    build_view,
    dequantize,
    weight_sources,
)

KINDS: list[ViewKind] = ["bf16", "fp16", "fp8_e4m3", "fp8_block", "int4_group", "nvfp4"]
PROJ = "model.layers.0.mlp.down_proj.weight"
QUANTIZED: tuple[ViewKind, ...] = ("fp8_e4m3", "fp8_block", "int4_group", "nvfp4")


def _state(seed: int, master: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(40, 256, generator=g).to(master)
    w = torch.randn(300, 256, generator=g) * 0.02
    w[5, 7] = 0.5  # an outlier, so blocks differ in scale
    w[130:, 128:] = 0.0  # an all-zero block
    return {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,
        PROJ: w.to(master),
        "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=master),
        "model.layers.0.mlp.down_proj.bias": torch.zeros(300, dtype=master),
        "rotary.inv_freq_ids": torch.arange(8),
    }


def _adam_step(
    state: dict[str, torch.Tensor], seed: int, lr: float = 1e-3
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.is_floating_point():
            out[name] = t + lr * torch.sign(torch.randn(t.shape, generator=g)).to(t.dtype)
        else:
            out[name] = t.clone()
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("kind", KINDS)
def test_layout_keeps_norms_embeddings_biases_and_ties(kind: ViewKind) -> None:
    view = build_view(_state(0), ViewSpec(kind=kind))
    keep_dtype = torch.float16 if kind == "fp16" else torch.bfloat16
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.mlp.down_proj.bias"):  # fmt: skip
        assert view[name].dtype == keep_dtype
    assert view["lm_head.weight"] is view["model.embed_tokens.weight"]
    assert view["rotary.inv_freq_ids"].dtype == torch.int64
    expected = {
        "bf16": {PROJ: torch.bfloat16},
        "fp16": {PROJ: torch.float16},
        "fp8_e4m3": {PROJ: torch.float8_e4m3fn, f"{PROJ}_scale": torch.float32},
        "fp8_block": {PROJ: torch.float8_e4m3fn, f"{PROJ}_scale_inv": torch.float32},
        "int4_group": {"model.layers.0.mlp.down_proj.weight_packed": torch.uint8,
                       "model.layers.0.mlp.down_proj.weight_scale": torch.bfloat16,
                       "model.layers.0.mlp.down_proj.weight_shape": torch.int64},
        "nvfp4": {PROJ: torch.uint8, f"{PROJ}_scale": torch.float8_e4m3fn,
                  f"{PROJ}_scale_2": torch.float32},
    }[kind]  # fmt: skip
    assert {k: view[k].dtype for k in expected} == expected
    if kind == "fp8_block":
        assert view[f"{PROJ}_scale_inv"].shape == (3, 2)
    if kind in ("int4_group", "nvfp4"):
        packed = "model.layers.0.mlp.down_proj.weight_packed" if kind == "int4_group" else PROJ
        assert view[packed].shape == (300, 128)


@pytest.mark.parametrize("kind", ["bf16", "fp8_e4m3"])
def test_a_transpose_is_not_an_alias(kind: ViewKind) -> None:
    """A square ``W`` and ``W.T`` share storage, offset, shape and dtype, not stride."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(4))
    state = {"a.norm.weight": w, "b.norm.weight": w.T, "c.norm.weight": w}
    view = build_view(state, ViewSpec(kind=kind))
    assert torch.equal(view["b.norm.weight"].float(), w.T.to(torch.bfloat16).float())
    assert not torch.equal(view["a.norm.weight"], view["b.norm.weight"])
    assert view["c.norm.weight"] is view["a.norm.weight"]  # a true alias stays one tensor


def test_view_does_not_alias_the_trainer_state() -> None:
    state = _state(1, master=torch.bfloat16)
    view = build_view(state, ViewSpec(kind="bf16"))
    state[PROJ].add_(1.0)
    assert not torch.equal(view[PROJ], state[PROJ])


def _nearest_error(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return (x[..., None] - grid).abs().min(dim=-1).values


@pytest.mark.parametrize("policy", ["fresh", "pow2"])
def test_fp8_views_match_reference(policy: str) -> None:
    w = _state(2)[PROJ]
    for kind in ("fp8_e4m3", "fp8_block"):
        spec = ViewSpec(kind=kind, scale_policy=policy)  # type: ignore[arg-type]
        view = build_view({PROJ: w}, spec)
        got = dequantize(view, spec)[PROJ]
        if kind == "fp8_e4m3":
            scale = view[f"{PROJ}_scale"].expand(w.shape)
            amax = w.abs().amax().expand(1, 1)
        else:
            s = view[f"{PROJ}_scale_inv"]
            scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :256]
            amax = torch.nn.functional.max_pool2d(w.abs()[None], 128, ceil_mode=True)[0]
        ref = amax / 448
        stored = view[f"{PROJ}_scale"] if kind == "fp8_e4m3" else view[f"{PROJ}_scale_inv"]
        if policy == "fresh":
            torch.testing.assert_close(stored.reshape(ref.shape), ref, rtol=1e-6, atol=0)
        else:
            nz = stored[stored > 0]
            assert torch.equal(torch.exp2(torch.log2(nz).round()), nz)
            assert torch.all(stored.reshape(ref.shape) >= ref)
        # e4m3 keeps 3 mantissa bits: nearest rounding is within 2^-4 relative (2^-10 subnormal)
        bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
        assert torch.all((got - w).abs() <= bound)
    assert torch.all(got[130:, 128:] == 0)


@pytest.mark.parametrize("policy", ["fresh", "pow2"])
def test_int4_group_matches_reference(policy: str) -> None:
    w = _state(3)[PROJ]
    spec = ViewSpec(kind="int4_group", scale_policy=policy)  # type: ignore[arg-type]
    view = build_view({PROJ: w}, spec)
    stem = "model.layers.0.mlp.down_proj."
    scale = view[f"{stem}weight_scale"].float()
    amax = w.reshape(300, 2, 128).abs().amax(-1)
    if policy == "fresh":
        assert torch.equal(view[f"{stem}weight_scale"], (amax / 7).to(torch.bfloat16))
    assert torch.equal(view[f"{stem}weight_shape"], torch.tensor([300, 256]))
    got = dequantize(view, spec)[PROJ].reshape(300, 2, 128)
    x = w.reshape(300, 2, 128) / torch.where(scale > 0, scale, 1)[..., None]
    grid = torch.arange(-8, 8, dtype=torch.float32)
    ref_err = _nearest_error(x, grid) * scale[..., None]
    assert torch.all((got - w.reshape(300, 2, 128)).abs() <= ref_err + 1e-7)
    assert torch.all(ref_err <= scale[..., None] * 0.5 * (1 + 2**-6))


@pytest.mark.parametrize("policy", ["fresh", "pow2"])
def test_nvfp4_matches_reference(policy: str) -> None:
    w = _state(4)[PROJ]
    spec = ViewSpec(kind="nvfp4", scale_policy=policy)  # type: ignore[arg-type]
    view = build_view({PROJ: w}, spec)
    g = view[f"{PROJ}_scale_2"]
    if policy == "fresh":
        torch.testing.assert_close(g, w.abs().amax() / (6 * 448), rtol=1e-6, atol=0)
    bs = view[f"{PROJ}_scale"].float()
    blocks = w.reshape(300, 16, 16)
    eff = bs[..., None] * g
    x = torch.where(eff > 0, blocks / torch.where(eff > 0, eff, 1), 0.0)
    grid = torch.cat([FP4_VALUES, -FP4_VALUES])
    got = dequantize(view, spec)[PROJ].reshape(300, 16, 16)
    # every code is a nearest E2M1 value of w / (block scale * global scale)
    ref_err = torch.where(eff > 0, _nearest_error(x, grid) * eff, blocks.abs())
    assert torch.all((got - blocks).abs() <= ref_err + 1e-5 * eff + 1e-9)
    assert torch.all(bs <= 448)


def test_fixed_scales_reuse_the_anchor_and_saturate() -> None:
    state = _state(5)
    for kind in QUANTIZED:
        spec = ViewSpec(kind=kind, scale_policy="fixed_between_anchors")
        anchor = build_view(state, spec)
        moved = dict(state)
        moved[PROJ] = state[PROJ] * 1.5
        view = build_view(moved, spec, anchor=anchor)
        scales = [k for k in view if k.endswith(("_scale", "_scale_inv", "_scale_2"))]
        assert scales
        for k in scales:
            assert torch.equal(_bits(view[k]), _bits(anchor[k])), (kind, k)
        if kind == "fp8_e4m3":  # values past the anchor's range saturate at its largest code
            top = dequantize(view, spec)[PROJ].abs().max()
            assert top == 448 * anchor[f"{PROJ}_scale"] < moved[PROJ].abs().max()
        fresh = build_view(moved, ViewSpec(kind=kind))
        assert any(not torch.equal(_bits(fresh[k]), _bits(anchor[k])) for k in scales)


def test_pow2_scales_churn_less_than_fresh() -> None:
    state = _state(6)
    nxt = _adam_step(state, seed=1, lr=1e-4)

    def scale_changes(policy: str) -> int:
        spec = ViewSpec(kind="fp8_block", scale_policy=policy)  # type: ignore[arg-type]
        a, b = (
            build_view(state, spec)[f"{PROJ}_scale_inv"],
            build_view(nxt, spec)[f"{PROJ}_scale_inv"],
        )
        return int((_bits(a) != _bits(b)).sum())

    assert scale_changes("pow2") < scale_changes("fresh")


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
    master=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_views_reconstruct_exactly_through_the_codec(
    kind: ViewKind, seed: int, master: torch.dtype
) -> None:
    spec = ViewSpec(kind=kind)
    s0 = _state(seed, master)
    s1 = _adam_step(s0, seed + 1)
    s2 = _adam_step(s1, seed + 2)
    v0, v1, v2 = (build_view(s, spec) for s in (s0, s1, s2))
    reader = {k: v.clone() for k, v in v0.items()}
    for prev, nxt in ((v0, v1), (v1, v2)):
        patch = encode_patch(prev, nxt)
        apply_patch(reader, patch)
        assert state_digest(reader) == read_patch_header(patch).target_digest
    assert reader.keys() == v2.keys()
    for k in v2:
        assert reader[k].dtype == v2[k].dtype
        assert torch.equal(_bits(reader[k]), _bits(v2[k])), k


@pytest.mark.parametrize("kind", QUANTIZED)
def test_weight_sources_name_codes_and_scales_and_leave_a_models_own_scales(
    kind: ViewKind,
) -> None:
    state = _state(0)
    state["model.layers.0.layer_scale"] = torch.ones(256)  # a parameter of the model's own
    view = build_view(state, ViewSpec(kind=kind))
    sources = weight_sources(view)
    stem = PROJ.removesuffix("weight")
    assert (
        sources[PROJ]
        == {
            "fp8_e4m3": (PROJ, f"{PROJ}_scale"),
            "fp8_block": (PROJ, f"{PROJ}_scale_inv"),
            "int4_group": (f"{stem}weight_packed", f"{stem}weight_scale", f"{stem}weight_shape"),
            "nvfp4": (PROJ, f"{PROJ}_scale_2", f"{PROJ}_scale"),
        }[kind]
    )
    assert sources["model.layers.0.layer_scale"] == ("model.layers.0.layer_scale",)
    assert {s for srcs in sources.values() for s in srcs} == set(view)  # every tensor, once
    full = dequantize(view, ViewSpec(kind=kind))
    assert full.keys() == sources.keys()
    assert torch.equal(full["model.layers.0.layer_scale"], torch.ones(256))
    only = dequantize(view, ViewSpec(kind=kind), only={PROJ})
    assert only.keys() == {PROJ}
    assert torch.equal(only[PROJ], full[PROJ])
