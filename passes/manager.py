"""The pass manager and the wrapper backend that applies unimem's rewrites to one model's graphs.

``torch.compile(fn, backend=manager.backend(inner="inductor"))`` hands every graph Dynamo captures to
:meth:`PassManager.apply` first (the Dynamo-level torch graph: SDPA is one node, the unimem op nodes are
unambiguous anchors) and then to the inner backend. This works for every inner backend (``aot_eager``
silently ignores passes given through ``options=``) and runs before any compile-cache lookup on torch
2.11 and 2.13 alike, so the per-rewrite counts are honest with a warm cache (DESIGN.md sections 5, 7).

A rewrite is an object with a ``name`` and ``__call__(gm) -> int`` (replacements made); one that does not
match leaves the graph unchanged and logs one line saying why.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch

__all__ = ["REWRITE_NAMES", "PassManager", "dump_dir"]

log = logging.getLogger("unimem_compile.passes")

#: FROZEN rewrite names, in the order they run.
REWRITE_NAMES = ("mla_write_fusion", "mla_absorb", "kda_state_inplace", "conv_state_inplace")


def dump_dir() -> Path | None:
    """Folder given by ``UNIMEM_DUMP_GRAPHS``: each graph is written there before and after the rewrites."""
    value = os.environ.get("UNIMEM_DUMP_GRAPHS")
    return Path(value) if value else None


class PassManager:
    """Runs the enabled rewrites on each captured graph and counts their replacements.

    Args:
        rewrites: the rewrite objects, in order (each with ``name`` and ``__call__(gm) -> int``).
        enabled: names to run: True = all, False = none, or a collection of names.

    Attributes:
        counts: ``{name: replacements}`` for every FROZEN name, summed over every graph compiled.
        graphs: number of graphs this manager has processed.

    Raises:
        ValueError: ``enabled`` names a rewrite that does not exist.
    """

    def __init__(self, rewrites: Sequence[Callable] = (), enabled: bool | Collection[str] = True):
        known = {r.name for r in rewrites} | set(REWRITE_NAMES)
        if enabled is True:
            names = set(known)
        elif enabled is False:
            names = set()
        else:
            names = set(enabled)
            unknown = names - known
            if unknown:
                raise ValueError(f"unknown rewrite(s) {sorted(unknown)}; known: {sorted(known)}")
        self.rewrites = [r for r in rewrites if r.name in names]
        self.enabled = frozenset(names)
        self.counts = {name: 0 for name in REWRITE_NAMES} | {r.name: 0 for r in rewrites}
        self.graphs = 0

    def apply(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Rewrite ``gm`` in place with every enabled rewrite; returns it."""
        self.graphs += 1
        folder = dump_dir()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"graph{self.graphs:03d}_before.py").write_text(gm.print_readable(False))
        for rewrite in self.rewrites:
            n = int(rewrite(gm))
            self.counts[rewrite.name] += n
        if self.rewrites:
            gm.graph.lint()
            gm.recompile()
        if folder is not None:
            (folder / f"graph{self.graphs:03d}_after.py").write_text(gm.print_readable(False))
        return gm

    def uuid(self) -> str:
        """Hash of the rewrites' sources and the enabled set, for Inductor's compile cache."""
        h = hashlib.sha256()
        h.update(repr(sorted(self.enabled)).encode())
        for rewrite in self.rewrites:
            module = inspect.getmodule(type(rewrite)) or inspect.getmodule(rewrite)
            source = inspect.getsource(module) if module is not None else repr(rewrite)
            h.update(source.encode())
        h.update(Path(__file__).read_bytes())
        return h.hexdigest()

    def backend(self, inner: str = "inductor", cudagraphs: bool = False) -> Callable:
        """A ``torch.compile`` backend: rewrite the Dynamo graph, then compile it with ``inner``.

        Args:
            inner: "inductor", "aot_eager", "eager" or any registered backend name.
            cudagraphs: Inductor's ``triton.cudagraphs`` (ignored by other inner backends).
        """

        def unimem_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
            self.apply(gm)
            if inner == "inductor":
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": bool(cudagraphs)})
            if inner == "eager":
                return gm.forward
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(inner)(gm, example_inputs)

        unimem_backend.manager = self  # type: ignore[attr-defined]
        return unimem_backend
