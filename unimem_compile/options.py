"""``CompileOptions``: the options of ``unimem_compile.compile``, checked once, in one frozen value.

``compile()`` builds one from its keyword arguments (docs/design.md section 5) before it touches the model,
so a refused option leaves the model compilable. Everything that can be checked without the model is
checked here, in ``__post_init__``; what needs the model's device (free memory for ``memory_budget``,
``cudagraphs`` / ``deferred_stop_check`` on a CPU model) is checked by ``compile()`` once it knows it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Collection

import torch

from .errors import GeometryError

__all__ = ["CompileOptions"]

#: the short dtype names the demo CLI and the README use, for compile(kv_dtype=...). "fp8_e4m3" is OCP e4m3
#: (torch.float8_e4m3fn, what NVIDIA GPUs and FlashMLA use) on every device; the FNUZ variant of AMD's
#: MI300 is asked for by its own name.
SHORT_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
                     "fp8_e4m3fn": "float8_e4m3fn", "fp8_e4m3fnuz": "float8_e4m3fnuz"}


@functools.cache
def _backend_names() -> tuple[str, ...]:
    return tuple(torch._dynamo.list_backends(exclude_tags=()))


def kv_dtype_of(kv_dtype) -> torch.dtype | None:
    """``kv_dtype`` as a torch dtype: a dtype, its name as transformers' ``dtype=`` takes it ("bfloat16",
    "torch.bfloat16", "float8_e4m3fn"), a short name of :data:`SHORT_DTYPE_NAMES` ("bf16", "fp8_e4m3") or
    ``fp8_<format>`` for torch's ``float8_<format>`` ("fp8_e5m2": a dtype, which ``compile()`` then refuses
    as a format the ops cannot store, listing those they can), or None. TypeError for anything else (the
    message lists the short names)."""
    if isinstance(kv_dtype, str):
        name = SHORT_DTYPE_NAMES.get(kv_dtype, kv_dtype.removeprefix("torch."))
        if name.startswith("fp8_") and isinstance(getattr(torch, "float8_" + name[4:], None), torch.dtype):
            name = "float8_" + name[4:]  # a spelling hint for a real format would send the caller astray
        if not isinstance(getattr(torch, name, None), torch.dtype):
            fp8 = " (fp8 is spelled 'fp8_e4m3')" if kv_dtype.lower().startswith(("fp8", "float8")) else ""
            raise TypeError(f"kv_dtype {kv_dtype!r} does not name a torch dtype{fp8}; accepted: a torch dtype, its "
                            f"name ('bfloat16', 'torch.float16', ...) or one of "
                            f"{', '.join(repr(n) for n in SHORT_DTYPE_NAMES)}")
        return getattr(torch, name)
    if kv_dtype is not None and not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype, a dtype name or None, got {kv_dtype!r}")
    return kv_dtype


def _budget(memory_budget) -> int | float | None:
    """``memory_budget`` checked: None, a positive int of bytes (numpy and other integer types become int)
    or a float fraction in (0, 1]."""
    if memory_budget is None:
        return None
    if not isinstance(memory_budget, (bool, int, float)) and hasattr(memory_budget, "__index__"):
        memory_budget = operator.index(memory_budget)  # numpy and other integer types: bytes
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise GeometryError(f"memory_budget must be bytes (int), a fraction in (0, 1] (float) or None, "
                            f"got {memory_budget!r}")
    if isinstance(memory_budget, float):
        if not 0 < memory_budget <= 1:
            raise GeometryError(f"a float memory_budget is a fraction of free memory in (0, 1], got {memory_budget}")
    elif memory_budget <= 0:
        raise GeometryError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
    return memory_budget


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """The options of one ``unimem_compile.compile`` call (see its docstring for what each one does).

    Attributes:
        max_batch_size: most rows one generate() call may have (a positive int).
        max_seq_len: most tokens a row may reach, prompt (pads included) + new tokens (a positive int).
        memory_budget: arena bytes (int), a fraction in (0, 1] of the device's free memory (float), or None
            (``max_batch_size`` full rows and their states). A numpy or other integer type becomes an int.
        page_size: tokens per KV page (a positive int).
        kv_dtype: the cached latent rows' dtype, None for the model's; a name given ("bfloat16", "bf16",
            "torch.float16", "fp8_e4m3" = ``torch.float8_e4m3fn``, "fp8_e4m3fnuz") becomes the torch dtype.
        passes: the rewrites to run: True (all of :data:`~unimem_compile.passes.REWRITE_NAMES`), False
            (none), or a name or a collection of names; held as the frozenset of the names after the check.
        backend: the inner ``torch.compile`` backend, a registered backend name.
        cudagraphs: CUDA graphs for decode: True, False, or None (the default: on for CUDA models, off
            elsewhere: :meth:`cudagraphs_for`). On, the decode runner captures every decode step in one
            ``torch.cuda.CUDAGraph`` per batch-size bucket, and a call that falls back to transformers' own
            decode loop gets Inductor's CUDA graphs for its decode graph.
        deferred_stop_check: True, False or None (automatic: CUDA generate() calls of at least
            ``DEFERRED_STOP_MIN_ROWS`` rows).
        tensor_parallel: shard the model over torch.distributed's default process group (a bool).

    Raises (in ``__post_init__``, in this order):
        ValueError: ``backend`` is not a registered backend name (the message lists them).
        TypeError: ``cudagraphs`` / ``deferred_stop_check`` / ``tensor_parallel`` is not one of the values
            above; ``kv_dtype`` is neither a torch dtype nor the name of one.
        GeometryError: a size that is not a positive int; a ``memory_budget`` that is none of the forms
            above.
        ValueError / TypeError: ``passes`` names an unknown rewrite / is none of the accepted forms (a
            mapping included).
    """

    max_batch_size: int
    max_seq_len: int
    memory_budget: int | float | None = None
    page_size: int = 64
    kv_dtype: torch.dtype | None = None
    passes: bool | Collection[str] = True
    backend: str = "inductor"
    cudagraphs: bool | None = None
    deferred_stop_check: bool | None = None
    tensor_parallel: bool = False

    def __post_init__(self) -> None:
        # imported on use, as compile() imports the passes: they pull in Inductor, which importing
        # unimem_compile alone should not
        from unimem_compile.passes import REWRITE_NAMES
        from unimem_compile.passes.manager import enabled_names

        if not isinstance(self.backend, str) or self.backend not in _backend_names():
            raise ValueError(f"backend must be the name of a registered torch.compile backend, got {self.backend!r}; "
                             f"registered: {', '.join(_backend_names())}")
        if not any(self.cudagraphs is a for a in (None, False, True)):
            raise TypeError(f"cudagraphs must be one of False, True, got {self.cudagraphs!r} (or None: on for CUDA "
                            "models, off elsewhere)")
        if not any(self.deferred_stop_check is a for a in (None, False, True)):
            raise TypeError(f"deferred_stop_check must be one of None, False, True, got {self.deferred_stop_check!r}")
        if self.tensor_parallel is not True and self.tensor_parallel is not False:
            raise TypeError(f"tensor_parallel must be False or True, got {self.tensor_parallel!r}")
        object.__setattr__(self, "kv_dtype", kv_dtype_of(self.kv_dtype))
        for name in ("max_batch_size", "max_seq_len", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise GeometryError(f"{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "memory_budget", _budget(self.memory_budget))
        object.__setattr__(self, "passes", enabled_names(self.passes, REWRITE_NAMES))

    def cudagraphs_for(self, device: torch.device) -> bool:
        """The ``cudagraphs`` setting for a model on ``device``: None resolves to whether it is a CUDA device
        (True on another device is passed on as given: Inductor ignores it there, and compile() warns)."""
        return device.type == "cuda" if self.cudagraphs is None else self.cudagraphs
