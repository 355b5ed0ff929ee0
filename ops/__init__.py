"""Custom ops of the ``unimem`` namespace (docs/design.md section 4): declaration + fake impl + pure-torch
reference + Triton kernel + checking launcher per op family. Import as ``unimem_compile.ops``; never as a
top-level ``ops`` (each op would register twice).

Modules: ``geometry`` (:class:`MLAGeometry`, the six-argument geometry tail of every MLA op), ``common``
(launcher checks, the state ops' slot footprints, the arena views and MLA row translation the op modules
share), ``translate`` (id translation), ``fp8`` (the fp8 MLA
row codec: Triton encode / decode helpers and the plain-torch quantise / dequantise), ``mla_write`` (fused
latent write), ``mla_gather`` (paged rows -> dense history), ``mla_decode`` (paged decode attention),
``mla_prefill`` (paged prefill attention, reached as ``unimem_compile.ops.mla_prefill``: its names are not
re-exported here),
``state`` (slot gather/scatter), ``conv`` (short-conv update in place), ``kda`` (Kimi Delta Attention
decode/prefill on slots), ``kda_chunk`` (functional chunked KDA for the Kimi-Linear adapter), ``kda_graphs``
(CUDA graphs of fla's ``chunk_kda`` per chunk-length bucket, which both KDA prefill paths replay),
``step_context`` (host copies of a step's device tables, published by the forward for ops that plan on the
host).
"""

from . import (conv, fp8, geometry, kda, kda_chunk, mla_decode, mla_gather, mla_prefill, mla_write, state, step_context,
               translate)
from .conv import *  # noqa: F401,F403
from .geometry import MLAGeometry  # noqa: F401
from .kda import *  # noqa: F401,F403
from .kda_chunk import *  # noqa: F401,F403
from .mla_decode import *  # noqa: F401,F403
from .mla_gather import *  # noqa: F401,F403
from .mla_write import *  # noqa: F401,F403
from .state import *  # noqa: F401,F403
from .translate import *  # noqa: F401,F403
