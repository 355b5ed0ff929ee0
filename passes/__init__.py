"""Graph rewrites of unimem-compile (DESIGN.md section 7), applied by a wrapper backend.

Import as ``unimem_compile.passes``. ``make_pass_manager(passes)`` builds the manager
``unimem_compile.compile`` uses; rewrite modules register themselves in ``REWRITES`` below, in the
FROZEN order of ``REWRITE_NAMES``.
"""

from __future__ import annotations

from collections.abc import Collection

from .manager import REWRITE_NAMES, PassManager, dump_dir

__all__ = ["REWRITE_NAMES", "PassManager", "dump_dir", "make_pass_manager", "all_rewrites"]


def all_rewrites() -> list:
    """One instance of every rewrite that exists, in the order they run."""
    from .conv_state_inplace import ConvStateInplace
    from .kda_state_inplace import KDAStateInplace

    return [KDAStateInplace(), ConvStateInplace()]


def make_pass_manager(passes: bool | Collection[str] = True) -> PassManager:
    """The manager for ``unimem_compile.compile(..., passes=passes)``."""
    return PassManager(all_rewrites(), passes)
