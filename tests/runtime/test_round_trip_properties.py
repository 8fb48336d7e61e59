"""Property tests (hypothesis): any layout of views over one storage survives a round trip
bitwise."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import swap_pass
from swap_pass import SwapTensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
          torch.bool, torch.complex64]


@st.composite
def view_layouts(draw):
    """A base storage and 1-3 strided views into it (offsets, transposes, steps)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(*shape, generator=gen, dtype=torch.float64) * 100
    base = base.to(dtype) if dtype is not torch.complex64 else torch.complex(base, -base).to(dtype)
    views = [base]
    for _ in range(draw(st.integers(0, 2))):
        dim = draw(st.integers(0, base.dim() - 1))
        size = base.shape[dim]
        start = draw(st.integers(0, size - 1))
        step = draw(st.integers(1, 2))
        index = (slice(None),) * dim + (slice(None, None, step),)
        view = base.narrow(dim, start, size - start)[index]
        if view.dim() > 1 and draw(st.booleans()):
            view = view.transpose(0, view.dim() - 1)
        views.append(view)
    keep_base = draw(st.booleans())
    return views if keep_base else views[1:] or views


@settings(max_examples=60, deadline=None)
@given(view_layouts())
def test_round_trip_any_layout_bitwise(views) -> None:
    refs = [(v.clone(), v.shape, v.stride(), v.storage_offset(), v.dtype) for v in views]
    nbytes = views[0].untyped_storage().nbytes()
    group = SwapTensors(views)
    assert group.nbytes == nbytes  # one storage: swapped once, whole
    group.swap_to_host()
    group.wait_d2h()
    assert all(v.untyped_storage().nbytes() == 0 for v in views)
    group.swap_to_device()
    group.wait_h2d()
    for v, (ref, shape, stride, offset, dtype) in zip(views, refs, strict=True):
        assert (v.shape, v.stride(), v.storage_offset(), v.dtype) == (shape, stride, offset, dtype)
        assert torch.equal(v, ref)
    assert swap_pass.swap_stats().host_bytes_in_use == 0
