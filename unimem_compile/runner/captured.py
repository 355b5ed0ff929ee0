"""What a captured decode step reads, and the check that it still reads it before a replay.

A ``torch.cuda.CUDAGraph`` replays its kernels on the device addresses they had at capture. A tensor the
step reads that is later replaced (an attribute re-assigned instead of written in place with ``copy_``,
``param.data = ...``, a ``resize_`` / ``set_`` that moves the storage) leaves the graph reading the old
address: stale values while the caching allocator keeps that memory, somebody else's bytes once it hands
the block out again, and an illegal memory access once ``empty_cache()`` gave it back to the driver. Page
ids and slot ids read from such memory send the kernels anywhere in the arena.

:class:`CapturedInputs` records, at capture, every tensor the runner knows its step reads (by name, with a
function that reads the same attribute path again), keeps those tensors referenced for as long as the graph
exists (so their memory is never freed under it), and :meth:`CapturedInputs.check` compares each path's
tensor now with the one captured: the same storage address, shape, strides and dtype, or
:class:`~unimem_compile.errors.CapturedInputMoved` naming the first one that differs, before anything
replays.

What it cannot see: memory that is not one of those tensors, such as the cuBLAS workspace the captured GEMMs
use (``decode._own_blas_workspace`` handles that one) or a kernel's own scratch memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from ..errors import CapturedInputMoved

__all__ = ["CapturedInputs", "describe"]


def describe(t: torch.Tensor) -> tuple:
    """``(data_ptr, shape, stride, dtype)`` of ``t``: what a captured kernel depends on (``data_ptr`` is the
    address of the first element, storage offset included; 0 for a storage whose memory was released under
    it, as Inductor's CUDA graph trees do with outputs of an earlier replay)."""
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


def _text(d: tuple) -> str:
    ptr, shape, stride, dtype = d
    return f"0x{ptr:x} {list(shape)} stride {list(stride)} {str(dtype).replace('torch.', '')}"


class CapturedInputs:
    """The tensors one captured step reads, with what each was at capture.

    Args:
        what: the step, as the error names it (e.g. ``"the captured decode step of bucket 4 (sampling=False)"``).
        tensors: ``(name, read)`` pairs. ``read`` is either a function returning the tensor the step reads
            under ``name`` now, by reading the same attribute path again (so a re-assigned attribute is
            seen), or a ``(dict, key)`` pair naming the entry ``dict[key]`` (a module's ``_parameters`` /
            ``_buffers`` table; a key removed from it reads as None).

    Raises:
        TypeError: a ``read`` that does not give a tensor (at construction).

    The tensors read at construction stay referenced by this object (their memory cannot be freed while it
    exists: keep it as long as the graph). Host cost of :meth:`check` on this project's idle 2-core CI CPU:
    about 0.3 us per entry (0.5-1 us on a loaded machine), most of it reading each tensor's address and
    shape through torch; the decode runner records a model's P parameters and buffers and ~30 more.
    """

    def __init__(self, what: str, tensors: Iterable[tuple[str, Callable[[], torch.Tensor] | tuple[dict, str]]]):
        self.what = what
        self._entries: list[tuple[str, Callable[[], torch.Tensor], torch.Tensor, tuple]] = []
        for name, read in tensors:
            if isinstance(read, tuple):
                table, key = read
                if not isinstance(table, dict):
                    raise TypeError(f"{what}: {name} names an entry of a {type(table).__name__}; the "
                                    f"(mapping, key) form takes a dict (a module's _parameters / _buffers)")
                read = functools.partial(table.get, key)
            t = read()
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: {name} is a {type(t).__name__}, not a tensor")
            self._entries.append((name, read, t, describe(t)))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list[str]:
        """The recorded tensors' names, in recording order."""
        return [e[0] for e in self._entries]

    def check(self) -> None:
        """Every recorded path holds a tensor with the captured address, shape, strides and dtype (another
        tensor object over the same memory, such as a re-wrapped Parameter, passes: the graph reads the same
        bytes and the host writes reach them). Reads nothing from the device.

        Raises:
            CapturedInputMoved: the first entry (in recording order) that differs (its name, both
                descriptions); nothing was replayed or changed.
        """
        for name, read, kept, captured in self._entries:
            now = read()
            # fast path, the common case: the captured object itself, at its address, with its shape (its
            # strides and dtype change only with its address: set_, .data = ...)
            if now is kept and now.data_ptr() == captured[0] and now.shape == captured[1]:
                continue
            if not isinstance(now, torch.Tensor) or describe(now) != captured:
                self._raise(name, captured, now)

    def _raise(self, name: str, captured: tuple, now) -> None:
        if isinstance(now, torch.Tensor):
            d = describe(now)
            if d[0] == 0:
                how = "its storage was released under it"
            elif d[0] != captured[0]:
                how = "it now lives at another address"
            else:
                how = "its shape, strides or dtype changed"
            now_text, now_desc = _text(d), d
        else:
            how, now_text, now_desc = f"it is now a {type(now).__name__}", repr(now), None
        raise CapturedInputMoved(
            f"{self.what} reads {name} at {_text(captured)}, but {name} is now {now_text}: {how} since the capture "
            f"(an attribute re-assigned instead of written in place with copy_, a tensor resized or set_, or "
            f"parameters replaced, e.g. by model.to()). Replaying would read memory the step no longer owns, so "
            f"nothing was replayed; write such tensors in place, or compile the model again",
            name=name, captured=captured, now=now_desc)
