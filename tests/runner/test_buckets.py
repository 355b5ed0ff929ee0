"""Batch-size buckets: 1, 2, 4, 8, 16, then multiples of 8, with max_batch_size always a bucket."""

import pytest

from unimem_compile.errors import GeometryError
from unimem_compile.runner import bucket_for, bucket_sizes


def test_bucket_sizes_follow_the_documented_grid():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(60) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60)


@pytest.mark.parametrize("max_batch_size", [1, 5, 16, 33, 64, 100])
def test_bucket_for_is_the_smallest_bucket_that_holds_the_rows(max_batch_size):
    sizes = bucket_sizes(max_batch_size)
    for rows in range(1, max_batch_size + 1):
        b = bucket_for(rows, max_batch_size)
        assert b in sizes and b >= rows
        assert all(s < rows for s in sizes if s < b)
        assert b - rows < 8  # padding never reaches a whole step of 8


def test_bad_row_counts_are_refused_with_the_numbers():
    with pytest.raises(GeometryError, match="9 rows.*max_batch_size=8"):
        bucket_for(9, 8)
    with pytest.raises(GeometryError, match="0 rows"):
        bucket_for(0, 8)
    with pytest.raises(GeometryError, match="0"):
        bucket_sizes(0)
    with pytest.raises(TypeError, match="rows"):
        bucket_for(2.0, 8)
