"""The torch change scan (the device-side encoder) against the compiled CPU scan: same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from policies.codec import apply_patch, checksums, encode_patch, state_digest
from policies.codec.changes import Changes, find_changes
from policies.codec.digests import raw_bytes
from policies.codec.ops import encode_section, unit_view
from policies.codec.scan import scan_tensor
from policies.codec.views import ViewKind, ViewSpec, build_view
from policies.errors import PatchError

State = dict[str, torch.Tensor]
DENSITIES = [0.0, 0.01, 0.1, 0.3, 0.8, 1.0]
KINDS: list[ViewKind] = ["bf16", "fp8_e4m3", "fp8_block", "int4_group", "nvfp4"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _assert_same_changes(got: Changes, want: Changes) -> None:
    assert np.array_equal(got.modes, want.modes)
    for field in ("spos", "svals", "bpos", "bvals"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == w.dtype, field
        assert np.array_equal(g, w), field
    assert got.dense_changed == want.dense_changed
    assert got.old_words is not None
    assert want.old_words is not None
    assert np.array_equal(got.old_words, want.old_words)  # summed on the device alike


def _both_sections(b: torch.Tensor, t: torch.Tensor, width: int, chunk: int) -> tuple[bytes, ...]:
    """The section from the compiled scan of host units and from the torch scan of ``b``/``t``."""
    bu, tu = unit_view(raw_bytes(b), width), unit_view(raw_bytes(t), width)
    host = find_changes(bu, tu, chunk)
    scanned = scan_tensor(b, t, width, chunk)
    _assert_same_changes(scanned, host)
    floating = t.dtype.is_floating_point
    return (
        encode_section(bu, tu, host, floating, chunk).tobytes(),
        encode_section(None, None, scanned, floating, chunk).tobytes(),
    )


@st.composite
def unit_tensors(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Base and target integer tensors of a drawn width, changed at a drawn density."""
    width = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = np.dtype(f"<u{width}")
    chunk = draw(st.sampled_from([8, 16, 64, 256]))
    n = draw(st.integers(0, 5 * chunk + 7))
    base = draw(hnp.arrays(dtype, n))
    new = draw(hnp.arrays(dtype, n))
    density = draw(st.sampled_from(DENSITIES))
    keep = draw(hnp.arrays(np.float64, n, elements=st.floats(0, 1))) >= density
    target = np.where(keep, base, new)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    as_torch = [torch.from_numpy(a.view(f"<i{width}") if width > 1 else a) for a in (base, target)]
    return as_torch[0].view(ints), as_torch[1].view(ints), width, chunk


@settings(max_examples=150, deadline=None)
@given(unit_tensors())
def test_torch_scan_finds_what_the_compiled_scan_finds(
    case: tuple[torch.Tensor, torch.Tensor, int, int],
) -> None:
    b, t, width, chunk = case
    host, scanned = _both_sections(b, t, width, chunk)
    assert scanned == host


def _views(kind: ViewKind, rows: int, density: float, seed: int) -> tuple[State, State]:
    """Served views of a weight before and after ``density`` of its values moved."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(rows, 256, generator=g) * 0.02
    moved = torch.rand(rows, 256, generator=g) < density
    w1 = torch.where(moved, w0 + 0.01 * torch.randn(rows, 256, generator=g), w0)
    state0 = {"model.layers.0.mlp.down_proj.weight": w0, "model.norm.weight": w0[0].clone()}
    state1 = {"model.layers.0.mlp.down_proj.weight": w1, "model.norm.weight": w1[0].clone()}
    spec = ViewSpec(kind=kind)
    return build_view(state0, spec), build_view(state1, spec)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(KINDS),
    st.integers(1, 40),
    st.sampled_from(DENSITIES),
    st.sampled_from([8, 64, 1 << 16]),
    st.integers(0, 2**16),
)
def test_torch_scan_of_served_views_writes_the_same_sections(
    kind: ViewKind, rows: int, density: float, chunk: int, seed: int
) -> None:
    v0, v1 = _views(kind, rows, density, seed)
    for name, t in v1.items():
        width = min(t.element_size(), 8)
        host, scanned = _both_sections(v0[name], t, width, chunk)
        assert scanned == host, name


def test_a_base_and_target_on_two_devices_are_refused() -> None:
    b = torch.zeros(8, dtype=torch.int16)
    with pytest.raises(PatchError, match="base is on cpu and the target on meta"):
        scan_tensor(b, b.to("meta"), 2, 8)


@CUDA
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density", [0.0, 0.01, 1.0])
def test_a_patch_of_cuda_views_is_the_patch_of_their_host_copies(
    kind: ViewKind, density: float
) -> None:
    v0, v1 = _views(kind, 300, density, seed=1)
    sums, digest = checksums(v1), state_digest(v0)
    on_host = encode_patch(v0, v1, base_digest=digest, target_checksums=sums)
    d0 = {k: v.cuda() for k, v in v0.items()}
    d1 = {k: v.cuda() for k, v in v1.items()}
    on_device = encode_patch(d0, d1, base_digest=digest, target_checksums=sums)
    assert on_device == on_host
    out = apply_patch({k: v.clone() for k, v in v0.items()}, on_device)
    assert all(np.array_equal(raw_bytes(out[k]), raw_bytes(v1[k])) for k in v1)
