"""ops/step_context: a forward's published host copies are found by exact address, dtype and size, on the
publishing thread, only inside the ``with``; mla_prefill plans from the copy a generate() step publishes."""

import threading

import pytest
import torch

from unimem_compile.ops import step_context
from unimem_compile.ops.mla_prefill import _published


def _lengths(seed, n=6):
    return torch.randint(1, 1 << 20, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_a_published_copy_is_found_only_for_that_tensor_inside_the_with():
    dev, host = _lengths(1), _lengths(2)
    other = _lengths(3)
    assert step_context.host_copy(dev) is None
    with step_context.host_copies([(dev, host)]):
        got = step_context.host_copy(dev)
        assert got.data_ptr() == host.data_ptr() and torch.equal(got, host)
        assert torch.equal(_published(dev, None), host)
        assert _published(dev, other) is other  # an explicit kv_len_host wins
        assert step_context.host_copy(dev.view(2, 3)).shape == (2, 3)  # same address and size: reshaped
        for miss in (other, dev[1:], dev[:4], dev.view(torch.float32), dev.clone(), dev.view(2, 3).t()):
            assert step_context.host_copy(miss) is None  # another address, size, dtype or strides
        seen = []
        worker = threading.Thread(target=lambda: seen.append(step_context.host_copy(dev)))
        worker.start()
        worker.join()
        assert seen == [None]  # another thread's forward sees nothing of this one
        inner = _lengths(4)
        with step_context.host_copies([(dev, inner), (other, inner)]):
            assert step_context.host_copy(dev).data_ptr() == inner.data_ptr()
            assert step_context.host_copy(other) is not None
        assert step_context.host_copy(dev).data_ptr() == host.data_ptr() and step_context.host_copy(other) is None
    assert step_context.host_copy(dev) is None and _published(dev, None) is None


def test_a_copy_of_another_dtype_or_size_is_refused():
    dev = _lengths(5)
    with pytest.raises(ValueError, match=r"device torch.int32 x 6, host torch.int64 x 6"):
        with step_context.host_copies([(dev, dev.to(torch.int64))]):
            pass
    with pytest.raises(ValueError, match=r"device torch.int32 x 6, host torch.int32 x 5"):
        with step_context.host_copies([(dev, dev[:5].clone())]):
            pass
    with pytest.raises(ValueError, match=r"contiguous"):
        with step_context.host_copies([(dev.view(2, 3).t(), dev.view(3, 2).clone())]):
            pass
    assert step_context.host_copy(dev) is None
