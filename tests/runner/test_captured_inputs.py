"""The check that a captured decode step still reads the tensors it was captured with.

On a CPU there is no capture: the bookkeeping is tested on the objects the runner records. A compiled tiny
DeepSeek (compile() traces nothing until a call) gives the runner's real read set; a stand-in graph in a
bucket shows that ``replay()`` and ``run()`` check before they replay or write anything. The cuBLAS
workspace guard around a capture is tested for its order of calls (the GPU tests run a real capture).
"""

import types

import pytest
import torch

import unimem_compile
from unimem_compile.errors import CapturedInputMoved
from unimem_compile.hf.models import build_model
from unimem_compile.runner import decode as runner_decode
from unimem_compile.runner.captured import CapturedInputs, describe
from unimem_compile.runner.decode import StepGraphStats
from unimem_compile.runner.rows import Rows, RowSettings


def _holder(gen):
    return types.SimpleNamespace(table=torch.randint(0, 50, (4, 6), generator=gen, dtype=torch.int32),
                                 lengths=torch.randint(1, 90, (4,), generator=gen, dtype=torch.int32))


def _inputs(h):
    return CapturedInputs("the step", [("table", lambda: h.table), ("lengths", lambda: h.lengths)])


def test_in_place_writes_and_views_of_the_same_memory_pass(gen):
    h = _holder(gen)
    inputs = _inputs(h)
    assert len(inputs) == 2 and inputs.names == ["table", "lengths"]
    h.table.copy_(torch.randint(0, 50, (4, 6), generator=gen, dtype=torch.int32))
    h.lengths[1:] = 7
    h.table = h.table[:]  # another tensor object over the same bytes, shape and strides
    inputs.check()


def test_a_reassigned_attribute_raises_naming_it_with_both_addresses(gen):
    h = _holder(gen)
    inputs = _inputs(h)
    before = describe(h.lengths)
    h.lengths = h.lengths.clone()  # the bug class: a new tensor where the graph reads the old one
    with pytest.raises(CapturedInputMoved) as info:
        inputs.check()
    e = info.value
    assert e.name == "lengths" and e.captured == before and e.now == describe(h.lengths)
    assert e.captured[0] != e.now[0]
    msg = str(e)
    assert "the step reads lengths" in msg and "another address" in msg
    assert f"0x{before[0]:x}" in msg and f"0x{e.now[0]:x}" in msg and "[4]" in msg and "int32" in msg


def test_a_storage_swapped_under_the_same_tensor_raises(gen):
    h = _holder(gen)
    inputs = _inputs(h)
    h.table.set_(torch.randint(0, 50, (4, 6), generator=gen, dtype=torch.int32).untyped_storage(), 0, (4, 6), (6, 1))
    with pytest.raises(CapturedInputMoved, match="reads table .*another address"):
        inputs.check()


def test_a_resize_that_keeps_the_address_still_raises_for_the_shape(gen):
    h = _holder(gen)
    inputs = _inputs(h)
    ptr = h.lengths.data_ptr()
    h.lengths.resize_(2)  # shrinking keeps the storage: same address, another shape
    assert h.lengths.data_ptr() == ptr
    with pytest.raises(CapturedInputMoved, match=r"reads lengths .*shape, strides or dtype changed") as info:
        inputs.check()
    assert info.value.now == (ptr, (2,), (1,), torch.int32)


def test_a_path_that_holds_no_tensor_any_more_raises(gen):
    h = _holder(gen)
    inputs = _inputs(h)
    h.table = None
    with pytest.raises(CapturedInputMoved, match="it is now a NoneType") as info:
        inputs.check()
    assert info.value.now is None


def test_a_read_that_is_not_a_tensor_is_refused_at_construction():
    with pytest.raises(TypeError, match="the step: slots is a list, not a tensor"):
        CapturedInputs("the step", [("slots", lambda: [1, 2])])


def test_table_entries_catch_what_function_entries_catch_in_recording_order(gen):
    # the (dict, key) form the runner uses for parameters and buffers: one vectorised pass, and on any
    # difference the first entry in recording order is named, whichever form it has
    module = torch.nn.Linear(5, 3)
    h = _holder(gen)
    inputs = CapturedInputs("the step", [("table", lambda: h.table), ("weight", (module._parameters, "weight")),
                                         ("bias", (module._parameters, "bias")), ("lengths", lambda: h.lengths)])
    inputs.check()
    weight = module.weight
    module.weight = torch.nn.Parameter(weight.detach())  # another object over the same memory: passes
    inputs.check()
    ptr = module.bias.data_ptr()
    module.bias.requires_grad_(False).resize_(2)  # same object, same address, another shape
    h.lengths = h.lengths.clone()  # also moved, but recorded after the bias
    with pytest.raises(CapturedInputMoved, match=r"reads bias .*shape, strides or dtype changed") as info:
        inputs.check()
    assert info.value.name == "bias" and info.value.now == (ptr, (2,), (1,), torch.float32)
    del module._parameters["bias"]
    with pytest.raises(CapturedInputMoved, match="reads bias .*it is now a NoneType"):
        inputs.check()
    with pytest.raises(TypeError, match=r"the step: w names an entry of a SimpleNamespace; the \(mapping, key\) "
                                        r"form takes a dict"):
        CapturedInputs("the step", [("w", (types.SimpleNamespace(weight=weight), "weight"))])


def test_the_captured_tensors_stay_referenced(gen):
    h = _holder(gen)
    inputs = _inputs(h)
    old = h.table
    ptr = old.data_ptr()
    h.table = None
    del old
    kept = [e[2] for e in inputs._entries if e[0] == "table"][0]  # the graph's memory is not freed under it
    assert kept.data_ptr() == ptr


# ------------------------------------------------------------------------------------ the runner's read set
class _Graph:
    """Stands in for a torch.cuda.CUDAGraph: counts replays."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


@pytest.fixture(scope="module")
def compiled():
    model = build_model("deepseek-v3-tiny")
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=32, page_size=8, backend="aot_eager")
    return model


@pytest.fixture
def captured(compiled):
    """Bucket 4 of the runner with a stand-in graph for greedy steps and its recorded inputs; removed after."""
    runner = compiled.unimem.runner
    bucket = runner._bucket(4)
    graph = _Graph()
    bucket.graphs[False], bucket.stats[False] = graph, StepGraphStats(bucket=4, sampling=False, captured=True)
    bucket.inputs[False] = runner.captured_inputs(bucket, False)
    yield runner, bucket, graph
    for table in (bucket.graphs, bucket.stats, bucket.inputs):
        table.pop(False, None)


def test_the_read_set_covers_buffers_rows_pool_and_every_parameter(compiled, captured):
    runner, bucket, _ = captured
    names = bucket.inputs[False].names
    tensors = sum(1 for m in compiled.modules() for t in (*m._parameters.values(), *m._buffers.values())
                  if t is not None)
    assert len(names) == len(set(names)) == 10 + len(bucket.uploads) + 3 + 2 + len(Rows._fields) + 5 + tensors
    for name in ("bucket 4 cache.buffers.page_table", "bucket 4 buffers.kv_len", "bucket 4 upload 'slots' destination",
                 "bucket 4 cache.seq_length", "bucket 4 cache.write_loc", "row state finished", "row state out",
                 "pool.arena", "pool.s_v2p", "parameter lm_head.weight", "parameter model.embed_tokens.weight"):
        assert name in names, name


def test_replay_checks_before_it_replays(captured):
    runner, bucket, graph = captured
    runner.replay(bucket, False, 3)
    assert graph.replays == 3 and bucket.stats[False].steps == 3
    saved = bucket.buffers.page_table
    bucket.buffers.page_table = torch.full_like(saved, -1)  # re-assigned instead of written with copy_
    try:
        with pytest.raises(CapturedInputMoved,
                           match=r"bucket 4 \(sampling=False\) reads bucket 4 cache.buffers.page_table"):
            runner.replay(bucket, False, 2)
    finally:
        bucket.buffers.page_table = saved
    assert graph.replays == 3 and bucket.stats[False].steps == 3
    runner.replay(bucket, False, 1)  # put back: the same storage, so it replays again
    assert graph.replays == 4


@pytest.mark.parametrize("how", ["new Parameter", "param.data"])
def test_a_replaced_parameter_raises_naming_it(compiled, captured, how):
    runner, bucket, graph = captured
    module = compiled.lm_head
    saved = module.weight
    if how == "new Parameter":
        module.weight = torch.nn.Parameter(saved.detach().clone())
    else:
        saved_data = saved.data
        saved.data = saved.detach().clone()
    try:
        with pytest.raises(CapturedInputMoved, match="reads parameter lm_head.weight") as info:
            runner.replay(bucket, False, 1)
        assert info.value.name == "parameter lm_head.weight"
    finally:
        if how == "new Parameter":
            module.weight = saved
        else:
            saved.data = saved_data
    assert graph.replays == 0


def test_run_checks_before_it_writes_the_rows(compiled, captured, gen):
    runner, bucket, graph = captured
    state = runner.state
    before = {name: getattr(state, name).clone() for name in Rows._fields}
    saved = runner.handle.pool.v2p
    runner.handle.pool.v2p = saved.clone()
    cache = compiled.unimem.new_cache(3)
    try:
        ids = torch.randint(3, 1000, (3, 5), generator=gen)
        logits = torch.randn(3, compiled.config.vocab_size, generator=gen)
        settings = [RowSettings(max_new_tokens=6)] * 3
        with pytest.raises(CapturedInputMoved, match="reads pool.v2p"):
            runner.run(cache, ids, settings, logits)
    finally:
        runner.handle.pool.v2p = saved
        cache.release()
    assert graph.replays == 0
    for name, values in before.items():
        assert torch.equal(getattr(state, name), values), name


# ------------------------------------------------------------------------------------ the cuBLAS workspace guard
def test_a_capture_clears_the_cublas_workspaces_before_and_after_even_when_it_fails(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    with runner_decode._own_blas_workspace():
        calls.append("capture")
    assert calls == ["clear", "capture", "clear"]
    calls.clear()
    with pytest.raises(RuntimeError, match="capture failed"):
        with runner_decode._own_blas_workspace():
            calls.append("capture")
            raise RuntimeError("capture failed")
    assert calls == ["clear", "capture", "clear"]
