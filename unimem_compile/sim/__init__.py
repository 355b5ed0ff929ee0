"""The capacity simulator: the serving engine's FCFS scheduler over simulated memory systems (real pool code
on the ``meta`` device), seeded traces, and the measures of :func:`simulate` (:mod:`.simulate`)."""

from .simulate import (
    GIB,
    TRACES,
    PaddedHybridSystem,
    Request,
    SimResult,
    StaticSplitSystem,
    UnifiedSystem,
    padded_block_geometry,
    phased_trace,
    simulate,
    stationary_trace,
)

__all__ = ["GIB", "TRACES", "PaddedHybridSystem", "Request", "SimResult", "StaticSplitSystem", "UnifiedSystem",
           "padded_block_geometry", "phased_trace", "simulate", "stationary_trace"]
