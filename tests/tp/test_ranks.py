"""Two real ranks (torchrun, gloo, CPU, fp32, backend aot_eager): tokens, logits, pool sizes, agreement, and
bad launches refused on every rank without a hang.

``tests/tp/tp_worker.py`` runs every scenario once in one 2-rank launch (a module fixture) and each rank
writes what it saw; the tests below read both ranks' records. ``examples/generate_tp.py`` is run as a user
runs it. Each launch has a time limit: a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from unimem_compile.hf.adapters import adapter_for
from unimem_compile.hf.models import build_model
from unimem_compile.pool import ArenaLayout
from unimem_compile.tp.sizing import shard_state_spec

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
# the worker's sizes (tests/tp/tp_worker.py)
MAX_BATCH, PROMPT, NEW, PAGE = 3, 20, 10, 8
#: fp32 logits, |logit| <= ~1.4: the all-reduces add the ranks' partial sums in another order than one
#: process's matmuls (and mla_absorb reorders the attention against stock transformers): a few ulp per layer,
#: about 1e-6 measured. 1e-4 leaves room for that to grow over the layers and is still far below what a
#: wrong shard changes (order 0.1) or the top-2 logit gaps that greedy decoding separates.
LOGIT_ATOL = 1e-4
#: seconds one 2-rank launch may take before it counts as a hang (measured: about 70 s on a loaded 2-core CPU)
LAUNCH_LIMIT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, limit: float = LAUNCH_LIMIT_S) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node 2 ARGS`` on a free port, killed (its whole process
    group) after ``limit`` seconds."""
    # one compile thread per rank: two ranks share CI's two cores, and Inductor's compile-worker pool adds
    # processes and threads to each (a rank died once with "terminate called without an active exception" while
    # both compiled into a cold cache, 2026-12-02; not reproduced alone)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the 2-rank launch hung: killed after {limit} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    done = torchrun(str(WORKER), str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _errors(ranks, scenario) -> list[str | None]:
    return [r[scenario]["error"] for r in ranks]


# ---------------------------------------------------------------------------------------------- good runs
@pytest.mark.parametrize("name", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_greedy_tokens_equal_one_process_on_both_ranks(ranks, name):
    for r in ranks:
        good = r[f"good:{name}"]
        assert good["error"] is None
        assert good["tokens"] == good["reference"]
        assert len(good["tokens"]) == 2 and len(good["tokens"][0]) == NEW
        assert good["debug_tokens"] == [row[:3] for row in good["tokens"]]  # UNIMEM_DEBUG: tables agreed
    assert ranks[0][f"good:{name}"]["tokens"] == ranks[1][f"good:{name}"]["tokens"]


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_teacher_forced_logits_within_tolerance(ranks, name):
    for r in ranks:
        good = r[f"good:{name}"]
        assert good["max_abs_logit"] > 0.1  # real logits, not zeros
        assert good["max_abs_logit_diff"] <= LOGIT_ATOL


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_pool_bytes_per_rank_are_as_computed(ranks, name):
    adapter = adapter_for(build_model(name))
    state = shard_state_spec(adapter.state_spec, 2)
    pages = math.ceil((PROMPT + NEW) / PAGE) * MAX_BATCH
    expected = ArenaLayout.for_capacity(adapter.kv_spec, state, PAGE, pages, MAX_BATCH if state else 0)
    one_process = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, PAGE, pages,
                                           MAX_BATCH if state else 0)
    for r in ranks:
        good = r[f"good:{name}"]
        assert good["pool_bytes"] == expected.memory_budget
        assert good["page_bytes"] == one_process.page_bytes  # the latent rows are whole on every rank
        assert good["slot_bytes"] == (state.slot_bytes if state else 0)
    if state is not None:
        assert expected.memory_budget < one_process.memory_budget


def test_rewrites_still_match_on_local_heads(ranks):
    """Every graph is rewritten as on one process: the worker compiles one prefill graph per model and one
    decode-step graph per runner step it builds (greedy, sampled, the UNIMEM_DEBUG run), so the totals are
    the per-graph counts (kimi-linear-tiny: 2 MLA and 2 KDA layers; deepseek-v3-tiny: 3 MLA layers) times the
    graphs."""
    kimi = ranks[0]["good:kimi-linear-tiny"]["rewrites"]
    decode_graphs = kimi["mla_absorb"] // 2
    assert decode_graphs >= 1
    assert kimi == {"mla_write_fusion": 2 * (decode_graphs + 1), "mla_absorb": 2 * decode_graphs,
                    "kda_state_inplace": 2 * decode_graphs, "conv_state_inplace": 2 * decode_graphs,
                    "mla_prefill": 2}
    deepseek = ranks[0]["good:deepseek-v3-tiny"]["rewrites"]
    assert deepseek["mla_absorb"] >= 3 and deepseek["mla_absorb"] % 3 == 0
    assert deepseek["mla_prefill"] == 3
    assert ranks[0]["good:kimi-linear-tiny"]["local_config"]["linear_num_heads"] == 2


def test_the_collectives_are_inside_the_compiled_graphs(ranks):
    """deepseek-v3-tiny: one all-reduce after each attention and each MLP / MoE block of its 3 layers and one
    all-gather of the logits, in the prefill graph and in every decode-step graph the runner compiled
    (one per step it built: greedy, sampled, the UNIMEM_DEBUG run) alike."""
    for r in ranks:
        graphs = r["collectives_in_graphs"]["graphs"]
        assert len(graphs) >= 2  # a prefill graph and at least one decode-step graph
        for counts in graphs.values():
            assert counts == {"all_reduce": 6, "all_gather": 1, "wait": 7}


def test_sampling_draws_the_same_tokens_on_every_rank(ranks):
    """The worker seeds each rank differently; generate() hands every rank rank 0's generator states."""
    for name in ("kimi-linear-tiny", "deepseek-v3-tiny"):
        sampled = [r[f"good:{name}"]["sampled"] for r in ranks]
        assert sampled[0] == sampled[1]
        assert sampled[0] != ranks[0][f"good:{name}"]["tokens"]  # it did sample (temperature 1.5, full vocab)


# ---------------------------------------------------------------------------------------------- refusals
def test_diverged_page_tables_are_refused_on_every_rank(ranks):
    for error in _errors(ranks, "diverged_tables"):
        assert error.startswith("RankMismatch: a step's page tables (UNIMEM_DEBUG=1): the ranks differ: "
                                "rank 1's page tables differ from rank 0's")


def test_a_full_pool_on_one_rank_stops_every_rank(ranks):
    e0, e1 = _errors(ranks, "full_pool_on_rank1")
    assert e1.startswith("PoolExhausted: state side: asked for 2 slots")
    assert e0.startswith("RankMismatch: a step's page tables (UNIMEM_DEBUG=1): rank 1 failed: PoolExhausted")


def test_different_inputs_are_refused_on_every_rank(ranks):
    for error in _errors(ranks, "different_inputs"):
        assert error.startswith("RankMismatch: generate(): the ranks differ: rank 1's arguments differ")


def test_a_call_refused_on_one_rank_is_refused_on_every_rank(ranks):
    e0, e1 = _errors(ranks, "failing_call_on_rank1")
    assert e1 == "GeometryError: prompt (20 tokens, pads included) + new tokens = 35 tokens is longer than max_seq_len=30"
    assert e0.startswith("RankMismatch: generate(): rank 1 failed: GeometryError: prompt (20 tokens")


def test_the_model_still_generates_after_the_refusals(ranks):
    for r in ranks:
        assert r["after_refusals"]["error"] is None
        assert r["after_refusals"]["tokens"] == [row[:2] for row in r["good:kimi-linear-tiny"]["tokens"]]


@pytest.mark.parametrize("scenario, message", [
    ("mla_heads_3", "GeometryError: tensor parallel over 2 ranks: MLA layer 1 has 3 attention heads, not a multiple of 2"),
    ("kda_heads_3", "GeometryError: tensor parallel over 2 ranks: KDA layer 0 has 3 heads, not a multiple of 2"),
    ("expert_width_65", "GeometryError: tensor parallel over 2 ranks: model.layers.1.mlp.experts has "
                        "intermediate_dim 65, not a multiple of 2"),
    ("different_weights", "RankMismatch: compile(tensor_parallel=True): the ranks differ: rank 1's weights differ in "
                          "32 entries: model.embed_tokens.weight"),
    ("different_budget", "RankMismatch: compile(tensor_parallel=True): the ranks differ: rank 1's options differ in 1 "
                         "entry: memory_budget (1048576 on rank 0, 2097152 on rank 1)"),
    ("different_models", "RankMismatch: compile(tensor_parallel=True): the ranks differ: rank 1's model class differs "
                         "('KimiLinearForCausalLM' on rank 0, 'DeepseekV3ForCausalLM' on rank 1)"),
])
def test_bad_launches_are_refused_on_every_rank(ranks, scenario, message):
    for r in ranks:
        assert r[scenario]["error"].startswith(message)
        assert r[scenario]["seconds"] < 10  # refused at once: nobody waited for a timeout


def test_an_option_refused_on_one_rank_is_refused_on_every_rank(ranks):
    e0, e1 = _errors(ranks, "bad_option_on_rank1")
    assert e1 == "GeometryError: page_size must be a positive int, got 0"
    assert e0.startswith("RankMismatch: compile(tensor_parallel=True): rank 1 failed: GeometryError: page_size must "
                         "be a positive int, got 0")


def test_a_rank_that_never_compiles_makes_the_others_give_up_after_the_timeout(ranks):
    absent = ranks[0]["rank1_absent"]
    assert absent["error"].startswith("RankMismatch: compile(tensor_parallel=True): rank 0 waited 4 s "
                                      "(UNIMEM_TP_TIMEOUT) for all 2 ranks to enter compile()")
    assert 4 <= absent["seconds"] < 30


# ---------------------------------------------------------------------------------------------- the example
def test_generate_tp_example_prints_one_json_line():
    done = torchrun("examples/generate_tp.py", "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout  # rank 0 only, nothing else on stdout
    r = json.loads(lines[0])
    assert set(r) >= {"world_size", "tokens_match", "pool_bytes_per_rank", "pool_bytes_one_process", "tokens_per_s"}
    assert r["world_size"] == 2 and r["tokens_match"] is True and r["ranks_agree"] is True
    assert 0 < r["pool_bytes_per_rank"] < r["pool_bytes_one_process"]  # kimi-linear-tiny: half the KDA states
    assert r["tokens_per_s"] > 0
