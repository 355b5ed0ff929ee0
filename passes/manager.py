"""The pass manager and the wrapper backend that applies unimem's rewrites to one model's graphs.

``torch.compile(fn, backend=manager.backend(inner="inductor"))`` hands every graph Dynamo captures to
:meth:`PassManager.apply` first (the Dynamo-level torch graph: SDPA is one node, the unimem op nodes are
unambiguous anchors) and then to the inner backend. This works for every inner backend (``aot_eager``
silently ignores passes given through ``options=``) and runs before any compile-cache lookup on torch
2.11 and 2.13 alike, so the per-rewrite counts are honest with a warm cache (docs/design.md sections 5, 7).
The manager belongs to one model (``unimem_compile.compile`` makes one per call): its rewrites touch
that model's graphs and recompiles only.

The same manager is also an Inductor ``CustomGraphPass`` for users of plain ``torch.compile``::

    torch.compile(model, options={"pre_grad_custom_pass": make_pass_manager()})

Inductor then keys its cache on :meth:`PassManager.uuid`. On torch 2.13 Inductor runs such a pass after
its cache lookup (``pre_grad_pass_timing`` "late"), so on a warm cache the graph comes back rewritten
but the counts stay 0; add ``"pre_grad_pass_timing": "early"`` to the options there for honest counts.

A rewrite is an object with a ``name`` and ``__call__(graph) -> int`` (replacements made), usually a
:class:`~unimem_compile.passes.common.Rewrite`; one that does not match leaves the graph unchanged and
logs one line saying why.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from unimem_compile import env

from . import common

__all__ = ["REWRITE_NAMES", "enabled_names", "PassManager", "GraphRecord", "dump_dir", "check_dump_dir",
           "StandInRead", "mark_stand_in"]

log = logging.getLogger("unimem_compile.passes")
#: one INFO line per graph compiled (``logging.basicConfig(level=logging.INFO)`` shows them)
compile_log = logging.getLogger("unimem_compile.compile")

#: FROZEN rewrite names, in the order they run (``mla_prefill`` came later and runs last: it and
#: ``mla_absorb`` match disjoint graphs, so their order changes nothing, and the first four keep theirs).
REWRITE_NAMES = ("mla_write_fusion", "mla_absorb", "kda_state_inplace", "conv_state_inplace", "mla_prefill")

# numbers dumped graphs across every manager of the process, so two models never overwrite each other
_dump_serial = itertools.count(1)

# the live stand-ins (mark_stand_in), by id: a graph input that is one of them must be read by nothing
_stand_ins: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class StandInRead(RuntimeError):
    """A graph compiled for a step that passed a stand-in (:func:`mark_stand_in`) still reads it after the
    rewrites. Raised by :meth:`PassManager.backend` before the inner compile (Dynamo raises it wrapped in
    ``BackendCompilerFailed``); the caller runs the step again with the real tensor."""


def mark_stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """Register ``tensor`` as a stand-in for an input the rewritten graphs never read (generate()'s
    full-attention mask on a prefill step, ``unimem_compile/hf/masks.py``): its values are never written.
    A graph compiled with it as an input that still reads it after the rewrites raises
    :class:`StandInRead`. Returns ``tensor``."""
    _stand_ins[id(tensor)] = tensor
    return tensor


def dump_dir() -> Path | None:
    """Folder given by ``UNIMEM_DUMP_GRAPHS``: each graph is written there before and after the rewrites."""
    value = env.dump_graphs()
    return Path(value) if value else None


def check_dump_dir() -> Path | None:
    """Create the ``UNIMEM_DUMP_GRAPHS`` folder (parents included) and check that it takes files; returns it.

    Raises:
        OSError: the folder cannot be created or written, with the variable's name and value in the message.
    """
    folder = dump_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".unimem_write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(f"{env.DUMP_GRAPHS}={str(folder)!r}: cannot write graph dumps there "
                      f"({type(e).__name__}: {e})") from e
    return folder


def enabled_names(enabled: bool | Collection[str], known: Collection[str]) -> frozenset[str]:
    """The rewrite names ``enabled`` selects among ``known``: True = all, False = none, or a name or a
    collection of names (compile's ``passes=``).

    Raises:
        ValueError: a name not in ``known``.
        TypeError: ``enabled`` is none of those forms (a mapping included: its keys would silently count).
    """
    if enabled is True:
        return frozenset(known)
    if enabled is False:
        return frozenset()
    if isinstance(enabled, Mapping):  # {name: flag} would otherwise count as the collection of its keys
        raise TypeError(f"enabled (compile's passes=) must be True, False, a rewrite name or a collection of "
                        f"names, not a mapping (got {dict(enabled)!r}); pass the names to run, e.g. "
                        f"{sorted(k for k, v in enabled.items() if v)!r}")
    if isinstance(enabled, Collection):  # a str is one too: a single name
        names = frozenset({enabled} if isinstance(enabled, str) else enabled)
        unknown = names - set(known)
        if unknown:
            raise ValueError(f"unknown rewrite(s) {sorted(unknown)}; known: {sorted(known)}")
        return names
    raise TypeError(f"enabled (compile's passes=) must be True, False, a rewrite name or a collection of "
                    f"names, got {enabled!r}")


@dataclasses.dataclass
class GraphRecord:
    """One graph a manager processed (kept when ``PassManager.keep_graphs`` is set).

    Attributes:
        before: a copy of the graph as Dynamo captured it.
        after: the graph as handed to the inner backend (the live object, not a copy).
        counts: replacements per rewrite name in this graph.
    """

    before: torch.fx.Graph
    after: torch.fx.Graph
    counts: dict[str, int]


class PassManager(CustomGraphPass):
    """Runs the enabled rewrites on each captured graph and counts their replacements.

    Args:
        rewrites: the rewrite objects, in order (each with ``name`` and ``__call__(graph) -> int``).
        enabled: names to run, among ``rewrites``' names: True = all of them, False = none, or a name or a
            collection of names.
        keep_graphs: keep a :class:`GraphRecord` of every graph in :attr:`records` (for inspection and
            tests; costs a copy of each graph).

    Attributes:
        counts: ``{name: replacements}`` for every FROZEN name, summed over every graph processed.
        graphs: number of graphs this manager has processed.
        records: the :class:`GraphRecord` list when ``keep_graphs`` is set.
        reads_attention_mask: a prefill graph compiled through :meth:`backend` reads, after the rewrites, a
            4-D ``attention_mask`` input or a stand-in (:func:`mark_stand_in`): generate() then stops passing
            stand-ins for this model (``unimem_compile/hf/masks.py``).

    Raises:
        ValueError: ``enabled`` names a rewrite not among ``rewrites``.
        TypeError: ``enabled`` is none of the forms above (e.g. None).
    """

    def __init__(self, rewrites: Sequence[Callable] = (), enabled: bool | Collection[str] = True,
                 keep_graphs: bool = False):
        names = enabled_names(enabled, [r.name for r in rewrites])
        self.rewrites = [r for r in rewrites if r.name in names]
        self.enabled = names
        self.counts = {name: 0 for name in REWRITE_NAMES} | {r.name: 0 for r in rewrites}
        self.graphs = 0
        self.keep_graphs = keep_graphs
        self.records: list[GraphRecord] = []
        self.reads_attention_mask = False

    def __call__(self, graph: torch.fx.Graph | torch.fx.GraphModule) -> dict[str, int]:  # type: ignore[override]
        """Rewrite ``graph`` in place with every enabled rewrite (Inductor's ``CustomGraphPass`` entry;
        the caller recompiles). Returns this graph's ``{name: replacements}``; adds them to :attr:`counts`."""
        g = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
        self.graphs += 1
        serial = next(_dump_serial)
        folder = check_dump_dir()
        before = common.copy_graph(g) if self.keep_graphs else None
        if folder is not None:
            (folder / f"graph{serial:03d}_before.py").write_text(g.python_code("self", verbose=True).src)
        counts = {}
        for rewrite in self.rewrites:
            counts[rewrite.name] = int(rewrite(g))
            self.counts[rewrite.name] += counts[rewrite.name]
        if self.rewrites:
            g.lint()
        if any(counts.values()):
            log.debug("graph %d: %s", self.graphs, counts)
        if folder is not None:
            header = "".join(f"# {name}: {n}\n" for name, n in counts.items()) or "# no rewrites enabled\n"
            (folder / f"graph{serial:03d}_after.py").write_text(header + g.python_code("self", verbose=True).src)
        if before is not None:
            self.records.append(GraphRecord(before, g, counts))
        return counts

    def apply(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Rewrite ``gm`` in place with every enabled rewrite and recompile it; returns it."""
        self(gm.graph)
        if self.rewrites:
            gm.recompile()
        return gm

    def uuid(self) -> str:
        """Hash of the enabled set, the manager's and shared helpers' sources and each enabled rewrite's
        ``uuid()`` (its sources and settings): the key Inductor's compile cache uses for this pass."""
        h = hashlib.sha256()
        h.update(repr(sorted(self.enabled)).encode())
        h.update(Path(__file__).read_bytes())
        h.update(Path(common.__file__).read_bytes())
        for rewrite in self.rewrites:
            uuid = rewrite.uuid() if hasattr(rewrite, "uuid") else None
            if uuid is None:
                raise TypeError(f"rewrite {rewrite.name!r} has no uuid(): it cannot key a compile cache")
            h.update(f"{rewrite.name}={uuid}".encode())
        return h.hexdigest()

    def backend(self, inner: str = "inductor", cudagraphs: bool = False, prefill_graphs: bool = False) -> Callable:
        """A ``torch.compile`` backend: rewrite the Dynamo graph, then compile it with ``inner``.

        Args:
            inner: "inductor", "aot_eager", "eager" or any registered backend name.
            cudagraphs: Inductor's ``triton.cudagraphs`` for decode graphs (one token per row; ignored by
                other inner backends). Prefill graphs are not CUDA-graphed by this backend: each new prompt
                length would record (and keep memory for) a graph of its own.
            prefill_graphs: also CUDA-graph the other graphs (with ``cudagraphs``, Inductor only), partitioned
                around the ops tagged ``cudagraph_unsafe`` (``ops.common.HOST_PLANNED``: they run eagerly
                between the captured parts). For the second compiled forward that ``compile()`` keeps for
                ``UNIMEM_PREFILL_GRAPHS``: static graphs of the listed lengths only, so each records once.
        """

        def unimem_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
            start = time.perf_counter()
            family = graph_family(gm)  # before the rewrites: they may replace the nodes it reads
            self.apply(gm)
            self._check_inputs(gm, example_inputs)
            if inner == "inductor":
                from torch._inductor.compile_fx import compile_fx

                graphed = bool(cudagraphs) and (prefill_graphs or is_decode_graph(gm))
                patches = {"triton.cudagraphs": graphed}
                if graphed and prefill_graphs:
                    patches.update(_prefill_graph_patches(gm))
                    graphed = patches["triton.cudagraphs"]
                compiled = compile_fx(gm, example_inputs, config_patches=patches)
                if graphed:
                    compiled = _in_any_thread(compiled)
            elif inner == "eager":
                compiled = gm.forward
            else:
                from torch._dynamo.backends.registry import lookup_backend

                compiled = lookup_backend(inner)(gm, example_inputs)
            _log_compiled(family, inner, time.perf_counter() - start)
            return compiled

        unimem_backend.manager = self  # type: ignore[attr-defined]
        return unimem_backend

    def _check_inputs(self, gm: torch.fx.GraphModule, example_inputs) -> None:
        """After the rewrites: note a prefill graph that reads a 4-D ``attention_mask`` input, and refuse one
        that reads a stand-in (:class:`StandInRead`). Placeholders and ``example_inputs`` come in the same
        order (Dynamo's graph inputs)."""
        if is_decode_graph(gm):
            return
        for node, example in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            if not node.users or not isinstance(example, torch.Tensor):
                continue
            if _stand_ins.get(id(example)) is example:
                self.reads_attention_mask = True
                readers = ", ".join(sorted({str(u.target) for u in node.users}))
                raise StandInRead(f"the rewritten graph reads the stand-in input {node.name} "
                                  f"{list(example.shape)} ({readers}): a rewrite left its reader in place")
            if "attention_mask" in node.name and example.dim() == 4:
                self.reads_attention_mask = True

    def __repr__(self) -> str:
        return f"PassManager(enabled={sorted(self.enabled)}, counts={self.counts})"


def ensure_cudagraph_tls() -> None:
    """Give the calling thread the thread-local state Inductor's CUDA-graph trees look up.

    torch 2.11's ``torch._inductor.cudagraph_trees.get_obj`` sets that state up in the importing thread and in
    the threads autograd starts, and asserts in any other thread (``assert torch._C._is_key_in_tls(...)``): a
    CUDA-graphed graph called from the continuous-batching engine's loop thread, or from a user's thread,
    failed there (a one-token prefill chunk is a decode-shaped graph). torch 2.13 initialises the state for any
    thread itself (``cudagraph_trees._initialize_tls``); this does the same on the versions before it: a thread
    of its own gets its own tree-manager containers, as 2.13 gives it. Cheap enough per call (one attribute
    lookup once the state exists).
    """
    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees, "_initialize_tls") or hasattr(trees.local, "tree_manager_containers"):
        return
    if torch._C._is_key_in_tls("tree_manager_containers"):  # a thread autograd started: it has the state
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)


#: Ops of other libraries that a prefill graph may call and that read a device tensor back on the host
#: (transformers' MoE fallback loops over ``offs.tolist()`` when ``torch._grouped_mm`` does not apply, e.g. fp32
#: or small expert sizes): a CUDA graph cannot capture them, so a CUDA-graphed prefill runs them between its
#: captured parts, as it does the ops tagged ``cudagraph_unsafe`` (``ops.common.HOST_PLANNED``).
HOST_SYNCING_OPS = ("transformers::grouped_mm_fallback",)


def _op_name(target) -> str | None:
    """``"namespace::name"`` of an op-overload (packet) call target, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def _prefill_graph_patches(gm: torch.fx.GraphModule, partition_ops: bool | None = None) -> dict:
    """Inductor config of a CUDA-graphed prefill graph: ``graph_partition`` (the host-planned ops run eagerly
    between the captured parts) and :data:`HOST_SYNCING_OPS` as partition points
    (``custom_should_partition_ops``). On a torch without that option, a graph that calls one of them is
    not CUDA-graphed (``triton.cudagraphs`` False: capturing it would fail half way through a step).
    ``partition_ops``: whether the option exists (None: look)."""
    patches = {"triton.cudagraphs": True, "graph_partition": True}
    from torch._inductor import config as inductor_config

    if partition_ops is None:
        partition_ops = hasattr(inductor_config, "custom_should_partition_ops")
    if partition_ops:
        patches["custom_should_partition_ops"] = list(HOST_SYNCING_OPS)
    elif any(n.op == "call_function" and _op_name(n.target) in HOST_SYNCING_OPS for n in gm.graph.nodes):
        patches["triton.cudagraphs"] = False
    return patches


def _in_any_thread(compiled: Callable) -> Callable:
    """``compiled`` (an Inductor graph with CUDA graphs on) callable from any thread: see
    :func:`ensure_cudagraph_tls`."""

    @functools.wraps(compiled)  # keeps the attributes Dynamo reads off a compiled graph (``_boxed_call``)
    def run(*args, **kwargs):
        ensure_cudagraph_tls()
        return compiled(*args, **kwargs)

    return run


def graph_family(gm: torch.fx.GraphModule | torch.fx.Graph) -> str:
    """The shape family of a causal LM forward graph, from its ``input_ids`` placeholder: "decode step,
    batch 4", "prefill, batch 2, query length s0" (a symbolic size prints as its symbol); "graph" when there
    is no such placeholder."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    for node in graph.find_nodes(op="placeholder"):
        if "input_ids" not in node.name:
            continue
        shape = getattr(node.meta.get("example_value", node.meta.get("val")), "shape", None)
        if shape is None or len(shape) != 2:
            break
        batch, tokens = shape
        if isinstance(tokens, int) and tokens == 1:
            return f"decode step, batch {batch}"
        return f"prefill, batch {batch}, query length {tokens}"
    return "graph"


# what the compile log has said once in this process (the cache hint is the same for every graph)
_said_once: set[str] = set()


def _log_compiled(family: str, inner: str, seconds: float) -> None:
    """One INFO line per graph compiled (a first compile is otherwise minutes of silence on a CPU), and once
    per process where Inductor keeps what it compiled."""
    compile_log.info("compiled the %s graph with %s in %.1f s", family, inner, seconds)
    if inner == "inductor" and "cache hint" not in _said_once:
        _said_once.add("cache hint")
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        compile_log.info("Inductor keeps compiled graphs in %s (TORCHINDUCTOR_CACHE_DIR): a later process "
                         "compiling the same model with the same options loads them from there instead of "
                         "compiling again (the CPU demo's first generate(): 103 s cold, 12 s warm)", cache_dir())


def is_decode_graph(gm: torch.fx.GraphModule | torch.fx.Graph) -> bool:
    """Whether a Dynamo graph of a causal LM forward is a decode step: its ``input_ids`` placeholder has
    a static sequence length of 1. False when there is no such placeholder."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    for node in graph.find_nodes(op="placeholder"):
        if "input_ids" not in node.name:
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        shape = getattr(value, "shape", None)
        return shape is not None and len(shape) == 2 and isinstance(shape[1], int) and shape[1] == 1
    return False
