"""Batch-size buckets: the row counts a decode step graph is captured for.

A CUDA graph replays fixed shapes, so a step over ``rows`` live rows runs the graph of the smallest
bucket ``>= rows`` with the extra rows padded (cleared rows of the RowState: location -1, slot -1, nothing
written). Buckets are 1, 2, 4, 8, 16, then every multiple of 8 up to ``max_batch_size``, which is always a
bucket itself.

Why steps of 8: a decode step is bound by the bytes it reads (the weights once per step, each live row's
KV), and a padded row adds neither (its KV reads are masked); what it adds is its share of the GEMM and
elementwise work, which is small at decode. Steps of 8 bound that waste at 7 rows (at most 30 % of a bucket,
at 17 rows of 24; under 12.5 % from 56 rows) and keep the graph count at ``4 + max_batch_size / 8``
(20 graphs for 128 rows); steps of 16 would halve the graphs but double the worst padding. Nothing was
measured for this choice; the capture time and memory per bucket are what to measure when
``max_batch_size`` grows past a few hundred (vLLM and SGLang switch to coarser steps there).
"""

from __future__ import annotations

import bisect
import functools

from ..errors import GeometryError
from ..pool.allocator import as_int

__all__ = ["BUCKET_STEP", "bucket_sizes", "bucket_for"]

BUCKET_STEP = 8
"""Spacing of the buckets above 16 rows."""

_SMALL = (1, 2, 4, 8, 16)


@functools.lru_cache(maxsize=64)
def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The captured batch sizes for ``max_batch_size`` rows, ascending.

    Raises:
        TypeError: ``max_batch_size`` is not an integer.
        GeometryError: ``max_batch_size < 1``.
    """
    max_batch_size = as_int(max_batch_size, "max_batch_size")
    if max_batch_size < 1:
        raise GeometryError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [b for b in _SMALL if b <= max_batch_size]
    sizes += range(_SMALL[-1] + BUCKET_STEP, max_batch_size + 1, BUCKET_STEP)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


def bucket_for(rows: int, max_batch_size: int) -> int:
    """The smallest bucket of :func:`bucket_sizes` that holds ``rows`` rows.

    Raises:
        TypeError: an argument is not an integer.
        GeometryError: ``rows`` outside ``[1, max_batch_size]``.
    """
    rows = as_int(rows, "rows")
    sizes = bucket_sizes(max_batch_size)
    if not 1 <= rows <= sizes[-1]:
        raise GeometryError(f"a step over {rows} rows: a bucket holds 1 to max_batch_size={sizes[-1]} rows")
    return sizes[bisect.bisect_left(sizes, rows)]
