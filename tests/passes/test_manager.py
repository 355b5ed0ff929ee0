"""The pass manager: names, uuid() for Inductor's cache, and the same objects as an Inductor
``pre_grad_custom_pass`` under a plain ``torch.compile``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from unimem_compile.passes import REWRITE_NAMES, PassManager, Rewrite, all_rewrites, make_pass_manager
from unimem_compile.pool import ArenaLayout, MLASpec, UnifiedPool

L, R, DR, PS = 2, 32, 16, 4


def test_rewrites_run_in_the_frozen_name_order():
    names = [r.name for r in all_rewrites()]
    assert names == [n for n in REWRITE_NAMES if n in names]
    assert names[:2] == ["mla_write_fusion", "mla_absorb"]


def test_enabled_names_select_rewrites_and_unknown_names_raise():
    assert [r.name for r in make_pass_manager(["mla_absorb"]).rewrites] == ["mla_absorb"]
    assert make_pass_manager(False).rewrites == []
    assert set(make_pass_manager(["kda_state_inplace"]).counts) >= set(REWRITE_NAMES)
    with pytest.raises(ValueError, match="mla_absorbb"):
        make_pass_manager(["mla_absorbb"])


def test_an_explicit_rewrite_list_enables_exactly_those_and_bad_forms_are_refused():
    from unimem_compile.passes import MLAAbsorb

    manager = PassManager([MLAAbsorb()])
    assert manager.enabled == {"mla_absorb"} and "enabled=['mla_absorb']" in repr(manager)
    with pytest.raises(ValueError, match=r"unknown rewrite\(s\) \['mla_write_fusion'\]; known: \['mla_absorb'\]"):
        PassManager([MLAAbsorb()], enabled=["mla_write_fusion"])
    with pytest.raises(TypeError, match="must be True, False, a rewrite name or a collection of names, got None"):
        make_pass_manager(None)


def test_uuid_is_stable_across_processes_and_depends_on_the_enabled_set():
    here = make_pass_manager(True).uuid()
    code = "from unimem_compile.passes import make_pass_manager; print(make_pass_manager(True).uuid())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == other
    assert len({here, make_pass_manager(["mla_absorb"]).uuid(), make_pass_manager(False).uuid()}) == 3


class _Scaled(Rewrite):
    name = "mla_absorb"

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def sites(self, graph):
        return []

    def settings(self):
        return {"factor": self.factor}


def test_uuid_depends_on_rewrite_settings():
    def uuid(factor):
        return PassManager([_Scaled(factor)]).uuid()

    assert uuid(2) == uuid(2) != uuid(3)


def _write_step(arena, v2p, loc, kv, weight):
    """An RMSNorm'd latent written to the pool, then read back: the write fusion's pattern outside HF."""
    x, k_rope = kv.split([R, DR], dim=-1)
    x32 = x.to(torch.float32)
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    torch.ops.unimem.mla_kv_write(arena, v2p, loc, normed, k_rope, 1, L, PS, R, DR, torch.float32)
    return arena.view(torch.float32).sum()


def test_manager_is_an_inductor_pre_grad_pass_for_plain_torch_compile(gen):
    pool = UnifiedPool(ArenaLayout.for_capacity(MLASpec(L, R, DR, torch.float32), None, PS, 4, 0))
    pages = pool.alloc_pages(3)
    loc = torch.tensor([pages[0] * PS + 1, pages[2] * PS + 3, -1, pages[1] * PS], dtype=torch.int64)
    kv = torch.randn(4, R + DR, generator=gen)
    weight = torch.rand(R, generator=gen) + 0.5
    expected = pool.arena.clone()
    _write_step(expected, pool.v2p, loc, kv, weight)

    manager = make_pass_manager(True)
    assert isinstance(manager, CustomGraphPass)
    options = {"pre_grad_custom_pass": manager}
    if hasattr(torch._inductor.config, "pre_grad_pass_timing"):  # torch >= 2.13 runs it after the cache lookup
        options["pre_grad_pass_timing"] = "early"
    torch._dynamo.reset()
    compiled = torch.compile(_write_step, backend="inductor", options=options, fullgraph=True)
    compiled(pool.arena, pool.v2p, loc, kv, weight)
    assert manager.counts["mla_write_fusion"] == 1
    assert torch.equal(pool.arena, expected)


def test_cudagraphs_are_asked_of_inductor_for_decode_graphs_only(monkeypatch):
    """compile(cudagraphs=True): the prefill graph is compiled without CUDA graphs, the decode graph of
    transformers' own loop with them (Inductor itself is replaced by a recorder here: only the config it is
    handed matters); the decode runner's step never asks for them (it captures the step itself)."""
    import torch._inductor.compile_fx as inductor_entry

    import unimem_compile
    from unimem_compile.hf.models import build_model

    asked = []

    def recorder(gm, example_inputs, config_patches=None, **kw):
        asked.append((config_patches or {}).get("triton.cudagraphs"))
        return gm.forward

    monkeypatch.setattr(inductor_entry, "compile_fx", recorder)
    model = build_model("kimi-linear-tiny", dtype=torch.float32, device="cpu", seed=0)
    with pytest.warns(UserWarning, match="cudagraphs=True has no effect on a model on cpu"):
        unimem_compile.compile(model, max_batch_size=2, max_seq_len=32, backend="inductor", cudagraphs=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    model.unimem.use_runner = False
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert asked == [False, True]  # prefill, then the one decode graph
    model.unimem.use_runner = True
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert asked == [False, True, False]  # the runner's step of bucket 2


def test_the_mla_attention_rewrites_hash_the_chain_they_share(monkeypatch):
    from unimem_compile.passes import MLAAbsorb, MLAPrefill, common, mla_expansion

    hashed = []
    real = common.source_hash
    monkeypatch.setattr(common, "source_hash", lambda *paths, extra="": hashed.append(paths) or real(*paths, extra=extra))
    for rewrite in (MLAAbsorb(), MLAPrefill()):
        rewrite.uuid()
    assert all(mla_expansion.__file__ in paths for paths in hashed) and len(hashed) == 2
    assert MLAPrefill(16).uuid() == MLAPrefill(16).uuid() != MLAPrefill(32).uuid()


@pytest.mark.parametrize("tokens, family", [(5, "prefill, batch 2, query length 5"), (1, "decode step, batch 2")])
def test_every_graph_compiled_gets_an_info_line_with_its_shape_family(tokens, family, caplog):
    def forward(input_ids):
        return input_ids * 2

    compiled = torch.compile(forward, backend=make_pass_manager(False).backend("aot_eager"), fullgraph=True)
    with caplog.at_level("INFO", logger="unimem_compile.compile"):
        compiled(torch.randint(0, 9, (2, tokens)))
    lines = [r.getMessage() for r in caplog.records if r.name == "unimem_compile.compile"]
    assert len(lines) == 1 and lines[0].startswith(f"compiled the {family} graph with aot_eager in ")


def test_the_inductor_cache_hint_is_logged_once_per_process(caplog, monkeypatch):
    from unimem_compile.passes import manager

    monkeypatch.setattr(manager, "_said_once", set())
    with caplog.at_level("INFO", logger="unimem_compile.compile"):
        for _ in range(2):
            manager._log_compiled("decode step, batch 4", "inductor", 1.5)
    lines = [r.getMessage() for r in caplog.records if r.name == "unimem_compile.compile"]
    assert lines[0] == lines[2] == "compiled the decode step, batch 4 graph with inductor in 1.5 s"
    assert len(lines) == 3 and "TORCHINDUCTOR_CACHE_DIR" in lines[1] and "12 s warm" in lines[1]


def test_cudagraph_tls_in_a_thread_of_its_own(monkeypatch):
    """A CUDA-graphed decode graph called from a thread Python started (the engine's loop, a user's thread):
    torch 2.11's cudagraph trees assert there (the H200 engine test's failure). ensure_cudagraph_tls gives
    the thread containers of its own; on torch >= 2.13 (``_initialize_tls``) torch does it itself, so the
    old path is exercised by hiding that function."""
    import threading

    from torch._inductor import cudagraph_trees as trees

    from unimem_compile.passes.manager import ensure_cudagraph_tls

    monkeypatch.delattr(trees, "_initialize_tls", raising=False)
    main_containers = trees.local.tree_manager_containers
    seen = {}

    def thread():
        seen["before"] = hasattr(trees.local, "tree_manager_containers")
        ensure_cudagraph_tls()
        seen["containers"] = trees.local.tree_manager_containers
        seen["lock"] = trees.local.tree_manager_locks[0]
        ensure_cudagraph_tls()  # a second call keeps the thread's state
        seen["same"] = trees.local.tree_manager_containers is seen["containers"]

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert seen["before"] is False
    assert seen["containers"] == {} and seen["containers"] is not main_containers
    assert isinstance(seen["lock"], type(threading.Lock())) and seen["same"]
    assert trees.local.tree_manager_containers is main_containers  # the main thread's state untouched
