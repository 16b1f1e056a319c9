"""Properties of the runtime's pure pieces: microbatch split/join and shape headers."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.runtime.batch import join_microbatches, split_microbatches
from pipeline.runtime.comm import decode_header, encode_header
from pipeline.runtime.shapes import ShapeBook

_DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool, torch.bfloat16]


@given(m=st.integers(1, 6), per=st.integers(1, 4), width=st.integers(1, 3),
       as_tuple=st.booleans())
def test_split_then_join_is_the_identity(m: int, per: int, width: int, as_tuple: bool) -> None:
    x = torch.arange(m * per * width, dtype=torch.float32).reshape(m * per, width)
    batch = (x, x > 3) if as_tuple else x
    parts = split_microbatches(batch, m, "inputs")
    assert len(parts) == m
    joined = join_microbatches(parts)
    if as_tuple:
        assert torch.equal(joined[0], x) and torch.equal(joined[1], x > 3)
    else:
        assert torch.equal(joined, x)


_shapes = st.lists(st.integers(0, 9), max_size=4).map(tuple)


@given(is_tuple=st.booleans(),
       layout=st.lists(st.tuples(_shapes, st.sampled_from(_DTYPES)), min_size=1, max_size=6))
def test_headers_round_trip(is_tuple: bool, layout: list[tuple[tuple[int, ...], torch.dtype]]
                            ) -> None:
    meta = (is_tuple, tuple(layout))
    assert decode_header(encode_header(meta)) == meta


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_shape_book_caches_exactly_the_edges_that_never_varied(widths: list[int]) -> None:
    book = ShapeBook()
    book.begin_step(7)
    for width in widths:
        book.sending(1, (False, (((2, width), torch.float32),)))
    book.end_step()
    book.begin_step(7)
    header = book.sending(1, (False, (((2, widths[0]), torch.float32),)))
    assert (header is None) == (len(set(widths)) == 1)
