"""Graph rewrites of unimem-compile (docs/design.md section 7), applied by a wrapper backend.

Import as ``unimem_compile.passes``. ``make_pass_manager(passes)`` builds the manager
``unimem_compile.compile`` uses; :func:`all_rewrites` lists one instance of every rewrite, in the FROZEN
order of ``REWRITE_NAMES``. Shared matching helpers live in ``common``; each rewrite in its own module.
"""

from __future__ import annotations

from collections.abc import Collection

from .common import Refused, Rewrite
from .conv_state_inplace import ConvStateInplace
from .kda_state_inplace import KDAStateInplace
from .manager import REWRITE_NAMES, GraphRecord, PassManager, dump_dir
from .mla_absorb import MLAAbsorb
from .mla_prefill import MLAPrefill
from .mla_write_fusion import MLAWriteFusion

__all__ = [
    "REWRITE_NAMES",
    "PassManager",
    "GraphRecord",
    "Rewrite",
    "Refused",
    "MLAWriteFusion",
    "MLAAbsorb",
    "MLAPrefill",
    "KDAStateInplace",
    "ConvStateInplace",
    "dump_dir",
    "make_pass_manager",
    "all_rewrites",
]


def all_rewrites() -> list:
    """One fresh instance of every rewrite that exists, in the order they run (``REWRITE_NAMES``)."""
    rewrites = [MLAWriteFusion(), MLAAbsorb(), KDAStateInplace(), ConvStateInplace(), MLAPrefill()]
    order = {name: i for i, name in enumerate(REWRITE_NAMES)}
    return sorted(rewrites, key=lambda r: order[r.name])


def make_pass_manager(passes: bool | Collection[str] = True, *, keep_graphs: bool = False) -> PassManager:
    """The manager for ``unimem_compile.compile(..., passes=passes)``; also usable on its own as an
    Inductor ``pre_grad_custom_pass`` (see :mod:`unimem_compile.passes.manager`)."""
    return PassManager(all_rewrites(), passes, keep_graphs=keep_graphs)
