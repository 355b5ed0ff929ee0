"""Launch accounting for CUDA code: which kernels one call runs.

Used by the kernel benchmarks (``kernels_per_call`` in their JSON) and the GPU tests that hold an op to one
launch per call (the translation, norm and zero fill fused into it).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["cuda_kernels"]


def cuda_kernels(fn: Callable[[], object]) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches, in launch order (``torch.profiler``'s CUDA
    events; a CUDA-graph replay shows as the kernels it replays).

    ``fn`` runs twice: once untimed, so that compiles, autotuning and lazy allocations of the first call are
    not counted, then once under the profiler; both calls are followed by ``torch.cuda.synchronize()``.
    Raises ``RuntimeError`` when CUDA is not available (the profiler would record nothing and the empty
    list would read as "no launch")."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("cuda_kernels needs CUDA: torch.cuda.is_available() is False")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
