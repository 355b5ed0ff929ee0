"""Rewrite ``mla_write_fusion``: the ``kv_a_layernorm`` RMSNorm feeding ``mla_kv_write`` -> one
``mla_kv_write_rmsnorm`` (the norm computed inside the write kernel, docs/passes.md).

Before: transformers' ``KimiLinearRMSNorm`` / ``DeepseekV3RMSNorm`` (``DeepseekV2RMSNorm``) as Dynamo
records it, whose output reaches the cache's write only through views. The match is the search function
:func:`unimem_compile.ops.mla_write.rmsnorm_reference` itself, traced (:class:`~.pattern.Pattern`: a
function or a method, operands in either order, ``t.pow(2)`` or ``t * t``, any cast spelling)::

    x32 = x.to(torch.float32)                                   # x: [B, S, R], the un-normed latent
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    kv_nope = weight * y
    torch.ops.unimem.mla_kv_write(arena, v2p, loc, kv_nope.view(B, 1, S, R).reshape(B * S, R), k_rope, *G)
                                                                # G: the six values of an MLAGeometry

After (the norm's statistics and the weight multiply happen in the write kernel, with the same fp32
accumulation and the same roundings; :func:`unimem_compile.ops.mla_write.rmsnorm_reference`)::

    torch.ops.unimem.mla_kv_write_rmsnorm(arena, v2p, loc, x.reshape(-1, R), k_rope, weight, eps, *G)

Refused (one log line, graph unchanged; the reason names the first operation of the search function the
graph does not have): the written latent is not such an RMSNorm (e.g. its statistics not in fp32); the
normed value is also used elsewhere (e.g. returned, or read by a second cache); the norm casts back to a
dtype other than its input's; an ``eps`` that is not a constant; dtypes the kernel does not take.
"""

from __future__ import annotations

import inspect

import torch

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.common import COMPUTE_DTYPES
from unimem_compile.ops.geometry import MLAGeometry
from unimem_compile.ops.mla_write import rmsnorm_reference

from . import pattern
from .common import (
    VIEW_METHODS,
    Refused,
    Rewrite,
    check_closed,
    describe,
    dims,
    erase_matched,
    insert_call,
    is_function,
    is_method,
    is_op,
    op_arguments,
    value,
)
from .pattern import Pattern

__all__ = ["MLAWriteFusion"]

#: The search function is the fused kernel's own reference, transformers' RMSNorm operation for operation;
#: the matcher generates the spellings Dynamo may record for it (passes/pattern.py).
RMSNORM = Pattern(rmsnorm_reference, constants=("eps",), name="RMSNorm")


class MLAWriteFusion(Rewrite):
    """``mla_write_fusion``: see the module docstring. Sites: every ``mla_kv_write`` call."""

    name = "mla_write_fusion"
    extra_sources = (pattern.__file__, inspect.getsourcefile(rmsnorm_reference))  # the matcher, the search function

    def sites(self, graph):
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.mla_kv_write)]

    def match(self, graph, write):
        arguments = op_arguments(write)
        kv_nope, rank = arguments["kv_nope"], arguments["kv_lora_rank"]
        out, views = kv_nope, []
        while is_method(out, *VIEW_METHODS) or is_function(out, torch.reshape):
            views.append(out)
            out = out.args[0]
        norm = RMSNORM.match(out)
        x, weight, eps = (norm.bindings[name] for name in ("x", "weight", "eps"))
        x_dims, w_dims = dims(x), dims(weight)
        if not x_dims or x_dims[-1] != rank:
            raise Refused(f"the RMSNorm input {describe(x)} does not end in kv_lora_rank={rank}")
        if w_dims != (rank,):
            raise Refused(f"the RMSNorm weight {describe(weight)} is not a [{rank}] vector")
        for name, node in (("input", x), ("weight", weight)):
            dtype = value(node).dtype
            if dtype not in COMPUTE_DTYPES:
                raise Refused(f"the RMSNorm {name} is {dtype}; the fused kernel takes {COMPUTE_DTYPES}")
        if not value(weight).is_contiguous():
            raise Refused("the RMSNorm weight is not contiguous")
        matched = [write, *views, *norm.nodes]
        check_closed(matched)
        return write, arguments, x, weight, float(eps), matched

    def replace(self, graph, found):
        write, arguments, x, weight, eps, matched = found
        geometry = MLAGeometry.from_arguments(arguments)
        arena, v2p, loc, k_rope = (arguments[name] for name in ("arena", "v2p", "virt_loc", "k_rope"))
        with graph.inserting_before(write):
            flat = insert_call(graph, "reshape", (x, -1, geometry.kv_lora_rank), like=write, method=True)
            insert_call(graph, torch.ops.unimem.mla_kv_write_rmsnorm,
                        (arena, v2p, loc, flat, k_rope, weight, eps, *geometry.args()), like=write)
        erase_matched(graph, matched)
