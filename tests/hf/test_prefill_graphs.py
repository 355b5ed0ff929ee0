"""``UNIMEM_PREFILL_GRAPHS``: prefill steps of the listed lengths run a second compiled forward, static in its
length and compiled with Inductor's CUDA graphs partitioned around the host-planned ops.

On the CPU Inductor itself is replaced by a recorder (only the config it is handed, and which graphs are
compiled, matter here; the recorder runs the rewritten graph eagerly), so these tests check the routing, the
config, the static graphs and the tokens; tests/gpu/test_prefill_graphs_gpu.py runs the real CUDA graphs.
"""

import pytest
import torch

import unimem_compile
from unimem_compile import env
from unimem_compile.hf.models import build_model
from unimem_compile.hf.runtime import _graphed_prefill
from unimem_compile.passes.manager import _op_name, _prefill_graph_patches

from .generate_models import compiled_small, greedy


def _recorded_compile(monkeypatch):
    import torch._inductor.compile_fx as inductor_entry

    asked = []

    def recorder(gm, example_inputs, config_patches=None, **kw):
        ids = [e for n, e in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
               if "input_ids" in n.name and isinstance(e, torch.Tensor)]
        static = all(isinstance(d, int) for d in ids[0].shape) if ids else None
        patches = config_patches or {}
        asked.append((patches.get("triton.cudagraphs"), patches.get("graph_partition"), static,
                      tuple(ids[0].shape) if ids and static else None))
        if patches.get("graph_partition"):  # transformers' MoE fallback reads offsets on the host: a partition
            assert patches["custom_should_partition_ops"] == ["transformers::grouped_mm_fallback"]
            assert any(n.op == "call_function" and _op_name(n.target) == "transformers::grouped_mm_fallback"
                       for n in gm.graph.nodes)  # (this model calls it on the CPU)
        return gm.forward

    monkeypatch.setattr(inductor_entry, "compile_fx", recorder)
    return asked


def test_listed_lengths_route_to_the_static_cuda_graphed_forward_and_tokens_stay_stock(monkeypatch):
    asked = _recorded_compile(monkeypatch)
    stock = build_model("kimi-linear-tiny", dtype=torch.float32, device="cpu", seed=0)
    model = build_model("kimi-linear-tiny", dtype=torch.float32, device="cpu", seed=0)
    with pytest.warns(UserWarning, match="cudagraphs=True has no effect on a model on cpu"):
        unimem_compile.compile(model, max_batch_size=1, max_seq_len=64, page_size=8, backend="inductor",
                               cudagraphs=True)
    ids = torch.randint(3, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    expected = greedy(stock, ids, mask, 5)
    monkeypatch.setenv(env.PREFILL_GRAPHS, "8, 16")
    out = greedy(model, ids, mask, 5, prefill_chunk_size=8)  # chunks of 8, 8 and 5 tokens
    assert torch.equal(out, expected)
    assert model.unimem.prefill_graph_steps == 2  # the two chunks of 8; the last chunk (5) is a length not listed
    graphed = [a for a in asked if a[1]]
    # static graphs of 8 tokens with CUDA graphs and partitions: the first chunk's and the later chunks' (the
    # first has no history: transformers hands its layers other masks, a Python-level difference for Dynamo)
    assert graphed == [(True, True, True, (1, 8))] * 2
    others = [a for a in asked if not a[1]]
    assert all(a[0] is False for a in others if a[3] != (1, 1))  # the dynamic prefill graph: no CUDA graphs

    compiles = len(asked)
    out = greedy(model, ids, mask, 5, prefill_chunk_size=8)  # the same lengths again: nothing new compiles
    assert torch.equal(out, expected) and len(asked) == compiles and model.unimem.prefill_graph_steps == 4

    # another prompt length: its chunks of 8 reuse both static graphs (no graph specialises to the prompt: the
    # first chunk's position ids are a view of the whole prompt's, with its length in their stride)
    longer = torch.randint(3, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(12))
    out = greedy(model, longer, torch.ones_like(longer), 5, prefill_chunk_size=8)
    assert torch.equal(out, greedy(stock, longer, torch.ones_like(longer), 5))
    assert len([a for a in asked if a[1]]) == 2 and model.unimem.prefill_graph_steps == 8

    model.unimem.prefill_graphs_exhausted = True  # (past the recompile limit): the symbolic forward only
    out = greedy(model, ids, mask, 5, prefill_chunk_size=8)
    assert torch.equal(out, expected) and model.unimem.prefill_graph_steps == 8
    model.unimem.prefill_graphs_exhausted = False

    monkeypatch.delenv(env.PREFILL_GRAPHS)
    out = greedy(model, ids, mask, 5, prefill_chunk_size=8)  # unset: every step runs the dynamic forward
    assert torch.equal(out, expected) and model.unimem.prefill_graph_steps == 8


def test_the_graphed_decision_takes_prefill_steps_of_the_listed_lengths_only(monkeypatch):
    model = compiled_small()
    cache = model.unimem.new_cache(1)
    try:
        ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(2))
        monkeypatch.setenv(env.PREFILL_GRAPHS, "6")
        assert _graphed_prefill({"input_ids": ids}, cache)
        assert not _graphed_prefill({"input_ids": ids[:, :5]}, cache)
        assert not _graphed_prefill({"input_ids": ids}, None)  # no UnifiedCache: not one of our steps
        assert not _graphed_prefill({"inputs_embeds": torch.randn(1, 6, 8)}, cache)
        monkeypatch.setenv(env.DEBUG, "1")  # the launchers' id checks read the device back: no capture then
        assert not _graphed_prefill({"input_ids": ids}, cache)
        monkeypatch.delenv(env.DEBUG)
        monkeypatch.setenv(env.PREFILL_GRAPHS, "1,6")
        with pytest.raises(ValueError, match=r"UNIMEM_PREFILL_GRAPHS must be comma-separated token counts >= 2 "
                                             r"\(e\.g\. '4096'\), got '1,6': '1' is not one"):
            _graphed_prefill({"input_ids": ids}, cache)
    finally:
        cache.release()


@pytest.mark.parametrize("raw, lengths", [("", frozenset()), (" ", frozenset()), ("4096", frozenset({4096})),
                                          ("2048, 4096,2048", frozenset({2048, 4096}))])
def test_prefill_graph_lengths_parse(monkeypatch, raw, lengths):
    monkeypatch.setenv(env.PREFILL_GRAPHS, raw)
    assert env.prefill_graph_lengths() == lengths


@pytest.mark.parametrize("raw, bad", [("4k", "4k"), ("4096,", ""), ("-2", "-2"), ("0", "0"), ("2.5", "2.5")])
def test_prefill_graph_lengths_refuse_what_is_not_a_length(monkeypatch, raw, bad):
    monkeypatch.setenv(env.PREFILL_GRAPHS, raw)
    with pytest.raises(ValueError, match=f"got {raw!r}: {bad!r} is not one"):
        env.prefill_graph_lengths()


def test_the_host_planned_ops_carry_the_cudagraph_unsafe_tag_and_the_device_only_ones_do_not():
    import unimem_compile.ops  # noqa: F401  (registers the ops)

    unsafe = {name for name in ("mla_prefill", "kda_chunk", "kda_prefill", "mla_kv_write", "mla_kv_write_rmsnorm",
                                "state_gather", "state_scatter", "mla_gather", "mla_decode")
              if torch.Tag.cudagraph_unsafe in getattr(torch.ops.unimem, name).default.tags}
    assert unsafe == {"mla_prefill", "kda_chunk", "kda_prefill"}


def test_without_inductor_partition_points_a_graph_calling_a_host_syncing_op_is_not_cuda_graphed():
    import transformers.integrations.moe  # noqa: F401  (defines transformers::grouped_mm_fallback)

    def graph(target):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(target, (x, x, x)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    syncing = graph(torch.ops.transformers.grouped_mm_fallback.default)
    plain = graph(torch.ops.aten.addcmul.default)
    assert _prefill_graph_patches(syncing, partition_ops=False) == {"triton.cudagraphs": False,
                                                                    "graph_partition": True}
    assert _prefill_graph_patches(plain, partition_ops=False) == {"triton.cudagraphs": True, "graph_partition": True}
    assert _prefill_graph_patches(syncing, partition_ops=True) == {
        "triton.cudagraphs": True, "graph_partition": True,
        "custom_should_partition_ops": ["transformers::grouped_mm_fallback"]}
    assert _op_name(torch.ops.transformers.grouped_mm_fallback) == "transformers::grouped_mm_fallback"
    assert _op_name(torch.ops.aten.addcmul.default) == "aten::addcmul" and _op_name(len) is None


def test_a_graphed_step_returns_its_own_copies_of_the_output_tensors():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from unimem_compile.hf.runtime import _own_outputs

    logits = torch.randn(1, 3, 11, generator=torch.Generator().manual_seed(4))
    sentinel = object()
    out = _own_outputs(CausalLMOutputWithPast(logits=logits, past_key_values=sentinel))
    assert torch.equal(out.logits, logits) and out.logits.data_ptr() != logits.data_ptr()
    assert out.past_key_values is sentinel  # the cache object itself, not copied
    assert _own_outputs(sentinel) is sentinel


def test_past_the_recompile_limit_the_step_and_later_ones_run_the_symbolic_forward(monkeypatch, caplog):
    from unimem_compile.hf import runtime

    model = compiled_small()
    handle = model.unimem
    calls = []

    def graphed(*args, **inputs):
        calls.append("graphed")
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

    def symbolic(*args, **inputs):
        calls.append(("symbolic", tuple(inputs)))
        return "out"

    monkeypatch.setattr(handle, "prefill_graphs_exhausted", False)
    monkeypatch.setattr(handle, "prefill_graph_steps", 0)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING", logger="unimem_compile.hf.runtime"):
        assert runtime._graphed_run(handle, graphed, symbolic, None)(input_ids=ids) == "out"
    assert calls == ["graphed", ("symbolic", ("input_ids",))]
    assert handle.prefill_graphs_exhausted and handle.prefill_graph_steps == 0
    assert f"recompile limit of {runtime.RECOMPILE_LIMIT} graphs" in caplog.text
