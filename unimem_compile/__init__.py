"""unimem-compile: one memory arena for hybrid MLA + linear-attention models under torch.compile.

    model = unimem_compile.compile(model, max_batch_size=8, max_seq_len=1024)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    print(model.unimem.stats())

See docs/design.md (architecture), README.md (usage) and benchmarks/RESULTS.md (measurements).
"""

from . import errors
from .compile import compile
from .errors import GeometryError, InvalidFree, PoolExhausted, RankMismatch, UnimemError, UnsupportedModel
from .hf.cache import UnifiedCache
from .hf.runtime import DEFERRED_STOP_MIN_ROWS, UnimemHandle
from .options import CompileOptions

__version__ = "0.1.0"

__all__ = [
    "compile",
    "UnifiedCache",
    "UnimemHandle",
    "CompileOptions",
    "DEFERRED_STOP_MIN_ROWS",
    "GeometryError",
    "InvalidFree",
    "PoolExhausted",
    "RankMismatch",
    "UnimemError",
    "UnsupportedModel",
    "errors",
    "__version__",
]
