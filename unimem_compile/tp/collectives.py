"""The collectives a tensor-parallel forward runs, as forward hooks over ``torch.distributed``'s functional
collectives (the form gpt-fast uses): Dynamo traces them with ``fullgraph=True``, so they sit inside the
compiled graphs (and inside their CUDA graphs on GPUs) as ``_c10d_functional`` nodes; NCCL runs them on CUDA
tensors, gloo on CPU tensors.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

__all__ = ["all_reduce_sum", "all_gather_last_dim", "reduce_hook", "gather_hook"]

# torch 2.13 deprecates all_gather_tensor for all_gather_single (same arguments); torch 2.11 has only the former
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The elementwise sum of ``x`` over the ranks of ``group``: a new tensor of ``x``'s shape and dtype
    (every rank gets the same bytes: NCCL and gloo reduce each element once and broadcast it)."""
    return funcol.all_reduce(x, "sum", group)


def all_gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x [..., n]`` of every rank of ``group`` concatenated in rank order along the last dimension:
    ``[..., world_size * n]``, a new tensor."""
    return _all_gather(x.contiguous(), x.dim() - 1, group)


def reduce_hook(group: ProcessGroup):
    """A forward hook replacing a module's output (a partial sum over this rank's shard) by its all-reduce."""

    def all_reduce_output(module, args, output):
        return all_reduce_sum(output, group)

    return all_reduce_output


def gather_hook(group: ProcessGroup):
    """A forward hook replacing a module's output (this rank's slice of the last dimension) by the
    concatenation of every rank's slice."""

    def all_gather_output(module, args, output):
        return all_gather_last_dim(output, group)

    return all_gather_output
