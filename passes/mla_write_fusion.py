"""Rewrite ``mla_write_fusion``: the ``kv_a_layernorm`` RMSNorm feeding ``mla_kv_write`` -> one
``mla_kv_write_rmsnorm`` (the norm computed inside the write kernel, docs/passes.md).

Before: transformers' ``KimiLinearRMSNorm`` / ``DeepseekV3RMSNorm`` (``DeepseekV2RMSNorm``) as Dynamo
records it, whose output reaches the cache's write only through views::

    x32 = x.to(torch.float32)                                   # x: [B, S, R], the un-normed latent
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    kv_nope = weight * y
    torch.ops.unimem.mla_kv_write(arena, v2p, loc, kv_nope.view(B, 1, S, R).reshape(B * S, R), k_rope, *G)
                                                                # G: the six values of an MLAGeometry

After (the norm's statistics and the weight multiply happen in the write kernel, with the same fp32
accumulation and the same roundings; :func:`unimem_compile.ops.mla_write.rmsnorm_reference`)::

    torch.ops.unimem.mla_kv_write_rmsnorm(arena, v2p, loc, x.reshape(-1, R), k_rope, weight, eps, *G)

Refused (one log line, graph unchanged): the written latent is not such an RMSNorm; the normed value is
also used elsewhere (e.g. returned, or read by a second cache); the norm casts back to a dtype other
than its input's; an ``eps`` that is not a constant; dtypes the kernel does not take.
"""

from __future__ import annotations

import operator

import torch

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.common import COMPUTE_DTYPES
from unimem_compile.ops.geometry import MLAGeometry

from .common import (
    VIEW_METHODS,
    Refused,
    Rewrite,
    argument,
    cast_of,
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

__all__ = ["MLAWriteFusion"]

_MULS = (operator.mul, torch.mul)
_ADDS = (operator.add, torch.add)


def _other(node: torch.fx.Node, known: object) -> object:
    a, b = node.args[:2]
    return b if a is known else a


def _rmsnorm(out: torch.fx.Node, rank: int) -> tuple[torch.fx.Node, torch.fx.Node, float, list[torch.fx.Node]]:
    """Match ``out = weight * (x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps)).to(x.dtype)`` with
    ``x32 = x.to(float32)``; returns ``(x, weight, eps, matched nodes)``."""
    if not is_function(out, *_MULS) or len(out.args) != 2:
        raise Refused(f"the written latent comes from {describe(out)}, not an RMSNorm weight multiply")
    a, b = out.args
    y_cast = cast_of(a) or cast_of(b)
    if y_cast is None:
        raise Refused("the written latent is a product without the RMSNorm's cast back to the input dtype")
    y = a if cast_of(a) else b
    weight = _other(out, y)
    z, y_dtype = y_cast
    if not is_function(z, *_MULS) or len(z.args) != 2:
        raise Refused(f"RMSNorm: expected x * rsqrt(...), found {describe(z)}")
    rsqrt = next((arg for arg in z.args if is_function(arg, torch.rsqrt) or is_method(arg, "rsqrt")), None)
    if rsqrt is None:
        raise Refused("RMSNorm: no rsqrt factor")
    x32 = _other(z, rsqrt)
    add = rsqrt.args[0]
    if not is_function(add, *_ADDS) or len(add.args) != 2:
        raise Refused(f"RMSNorm: expected variance + eps, found {describe(add)}")
    eps = next((arg for arg in add.args if isinstance(arg, (int, float)) and not isinstance(arg, bool)), None)
    if eps is None:
        raise Refused("RMSNorm: eps is not a constant")
    mean = _other(add, eps)
    if not (is_method(mean, "mean") or is_function(mean, torch.mean)):
        raise Refused(f"RMSNorm: expected a mean of squares, found {describe(mean)}")
    dim = argument(mean, 1, "dim", None)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if dim not in (-1, rank - 1) or not argument(mean, 2, "keepdim", False):
        raise Refused("RMSNorm: the mean is not over the last dimension with keepdim=True")
    square = mean.args[0]
    if is_method(square, "pow") or is_function(square, torch.pow, operator.pow):
        if square.args[0] is not x32 or square.args[1] != 2:
            raise Refused("RMSNorm: the squared tensor is not the normalised one")
    elif not (is_function(square, *_MULS) and square.args[0] is x32 and square.args[1] is x32):
        raise Refused(f"RMSNorm: expected x32 ** 2, found {describe(square)}")
    x_cast = cast_of(x32)
    if x_cast is None or x_cast[1] != torch.float32:
        raise Refused("RMSNorm: the statistics are not computed in fp32")
    x = x_cast[0]
    x_value = value(x)
    if not isinstance(x_value, torch.Tensor) or y_dtype != x_value.dtype:
        raise Refused(f"RMSNorm casts back to {y_dtype}, not to its input's dtype")
    return x, weight, float(eps), [out, y, z, rsqrt, add, mean, square, x32]


class MLAWriteFusion(Rewrite):
    """``mla_write_fusion``: see the module docstring. Sites: every ``mla_kv_write`` call."""

    name = "mla_write_fusion"

    def sites(self, graph):
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.mla_kv_write)]

    def match(self, graph, write):
        arguments = op_arguments(write)
        kv_nope, rank = arguments["kv_nope"], arguments["kv_lora_rank"]
        out, views = kv_nope, []
        while is_method(out, *VIEW_METHODS) or is_function(out, torch.reshape):
            views.append(out)
            out = out.args[0]
        x, weight, eps, norm = _rmsnorm(out, len(dims(out) or ()))
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
        matched = [write, *views, *norm]
        check_closed(matched)
        return write, arguments, x, weight, eps, matched

    def replace(self, graph, found):
        write, arguments, x, weight, eps, matched = found
        geometry = MLAGeometry.from_arguments(arguments)
        arena, v2p, loc, k_rope = (arguments[name] for name in ("arena", "v2p", "virt_loc", "k_rope"))
        with graph.inserting_before(write):
            flat = insert_call(graph, "reshape", (x, -1, geometry.kv_lora_rank), like=write, method=True)
            insert_call(graph, torch.ops.unimem.mla_kv_write_rmsnorm,
                        (arena, v2p, loc, flat, k_rope, weight, eps, *geometry.args()), like=write)
        erase_matched(graph, matched)
