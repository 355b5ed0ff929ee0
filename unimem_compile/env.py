"""Every environment variable unimem-compile reads, in one place.

Each variable is read when it is used (per call, never cached at import), so a test or a benchmark may set
it at any time; each has one function here that says what it means. This module imports nothing of the
project, so the pool, the ops and the passes can all use it.

| variable | values | default | effect |
|---|---|---|---|
| ``UNIMEM_ASYNC_UPLOADS`` | ``0``, or anything else | unset | ``0``: prefill steps copy their per-step host tables to the GPU with blocking copies (each waits for every queued kernel) and read a chunk's attention mask back from the GPU, and ``mla_prefill`` reads ``kv_len`` back, instead of pinned non-blocking copies, the host copy of the mask taken once per generate() call and the host lengths the step's forward publishes (``unimem_compile.pool.staging.upload``, ``UnifiedCache.remember_mask``, ``unimem_compile.ops.step_context``; A/B runs, debugging) |
| ``UNIMEM_DEBUG`` | ``1``, or anything else | unset | ``1``: every op launcher checks its ids against the live set (one device sync per call) and a ``UnifiedPool`` poisons free pages and slots with NaN bytes (docs/reliability.md) |
| ``UNIMEM_DUMP_GRAPHS`` | a folder path | unset | every graph a pass manager processes is written there as Python, before and after the rewrites; ``compile()`` creates the folder and raises OSError if it cannot write there |
| ``UNIMEM_KDA_GRAPHS`` | ``0``, or anything else | unset | ``0``: CUDA prefills run flash-linear-attention's ``chunk_kda`` eagerly instead of replaying a captured graph per chunk-length bucket (``unimem_compile.ops.kda_graphs``; A/B runs, debugging) |
| ``UNIMEM_MLA_DECODE_KERNEL`` | ``auto``, ``portable``, ``wgmma`` | ``auto`` | the stage-1 form of every ``mla_decode`` launch that passes no ``kernel=`` (benchmarks, A/B runs); another value makes the launch raise ValueError |
| ``UNIMEM_PREFILL_CONV`` | ``conv``, ``shifted`` | ``conv`` | the Kimi-Linear prefill's short convolution: ``conv`` is transformers' ``F.conv1d(groups=C)`` (aten's depthwise kernel on CUDA), ``shifted`` K shifted multiply-adds that Inductor fuses into one pointwise kernel (``unimem_compile.hf.kda_kernels.causal_conv1d_shifted``; opt-in until a GPU run times it); another value makes the forward raise ValueError |
| ``UNIMEM_PREFILL_GRAPHS`` | token counts, comma-separated (``4096`` or ``2048,4096``) | unset | prefill steps of exactly that many tokens per row run a second compiled forward with Inductor's CUDA graphs (``triton.cudagraphs``, graph partitions around the ops that plan on the host: ``mla_prefill``, ``kda_chunk``, ``kda_prefill``); only on a model compiled with ``cudagraphs`` and the Inductor backend, never under ``UNIMEM_DEBUG=1``, one static graph per length and batch shape (docs/generate.md, "Prefill chunk graphs"); a value that is not such a list makes those steps raise ValueError |
| ``UNIMEM_STAND_IN_MASKS`` | ``0``, or anything else | unset | ``0``: generate()'s prefill steps get transformers' eager 4-D attention mask instead of an unwritten stand-in that no rewritten graph reads (``unimem_compile.hf.masks``; A/B runs, debugging) |
| ``UNIMEM_TP_TIMEOUT`` | seconds (a positive number) | ``300`` | how long a tensor-parallel rank waits for the others at a host-side check (``compile(tensor_parallel=True)``, each ``generate()`` call) before it raises ``RankMismatch``; another value makes those raise ValueError |
| ``TRITON_INTERPRET`` | ``1``, or anything else | unset | read by Triton when a kernel is defined (set it before importing ``unimem_compile``); ``1`` also lets the Triton launchers take CPU tensors |

The shell scripts read three more, which the package never does: ``UNIMEM_VENV`` (``scripts/*.sh``: the
virtual environment to create or use, default ``.venv``), ``UNIMEM_TEST_WORKERS`` (``scripts/test.sh``: pytest-xdist
workers of the whole suite, default 2; 1 runs it in one process) and ``UNIMEM_SHIM``
(``benchmarks/device_env.sh``: where it assembles the importable shim of the checkout, default
``/tmp/unimem_shim``).
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["ASYNC_UPLOADS", "DEBUG", "DUMP_GRAPHS", "KDA_GRAPHS", "MLA_DECODE_KERNEL", "PREFILL_CONV", "PREFILL_GRAPHS",
           "STAND_IN_MASKS", "TP_TIMEOUT", "async_uploads", "debug", "dump_graphs", "kda_graphs", "mla_decode_kernel",
           "overridden", "prefill_conv", "prefill_graph_lengths", "stand_in_masks", "tp_timeout_s", "triton_interpret"]

#: The variables' names (for messages and for code that sets them, e.g. a benchmark's ``--kernel``).
ASYNC_UPLOADS = "UNIMEM_ASYNC_UPLOADS"
DEBUG = "UNIMEM_DEBUG"
DUMP_GRAPHS = "UNIMEM_DUMP_GRAPHS"
KDA_GRAPHS = "UNIMEM_KDA_GRAPHS"
MLA_DECODE_KERNEL = "UNIMEM_MLA_DECODE_KERNEL"
PREFILL_CONV = "UNIMEM_PREFILL_CONV"
PREFILL_GRAPHS = "UNIMEM_PREFILL_GRAPHS"
STAND_IN_MASKS = "UNIMEM_STAND_IN_MASKS"
TP_TIMEOUT = "UNIMEM_TP_TIMEOUT"

#: seconds a tensor-parallel host-side check waits for the other ranks when UNIMEM_TP_TIMEOUT is unset: long
#: enough for ranks that load a large checkpoint at different speeds to meet at compile()
TP_TIMEOUT_DEFAULT_S = 300.0


def async_uploads() -> bool:
    """Whether prefill steps upload host tables, check their masks and plan ``mla_prefill`` without a stream
    synchronisation (``UNIMEM_ASYNC_UPLOADS`` is not ``0``; ``unimem_compile.pool.staging.upload``,
    ``unimem_compile.ops.step_context``)."""
    return os.environ.get(ASYNC_UPLOADS) != "0"


def debug() -> bool:
    """Whether ``UNIMEM_DEBUG=1``: launchers check every id against the live set, pools poison free memory."""
    return os.environ.get(DEBUG) == "1"


def dump_graphs() -> str | None:
    """The folder ``UNIMEM_DUMP_GRAPHS`` names, or None when it is unset or empty (no graph dumps)."""
    return os.environ.get(DUMP_GRAPHS) or None


def kda_graphs() -> bool:
    """Whether CUDA prefills may replay captured ``chunk_kda`` graphs (``UNIMEM_KDA_GRAPHS`` is not ``0``)."""
    return os.environ.get(KDA_GRAPHS) != "0"


def prefill_conv() -> str:
    """The Kimi-Linear prefill convolution's form: ``"conv"`` (``UNIMEM_PREFILL_CONV`` unset or empty) or
    ``"shifted"``.

    Raises:
        ValueError: another value."""
    raw = os.environ.get(PREFILL_CONV) or "conv"
    if raw not in ("conv", "shifted"):
        raise ValueError(f"{PREFILL_CONV} must be 'conv' or 'shifted', got {raw!r}")
    return raw


def prefill_graph_lengths() -> frozenset[int]:
    """The per-row token counts whose prefill steps run CUDA-graphed (``UNIMEM_PREFILL_GRAPHS``, e.g.
    ``"4096"`` or ``"2048, 4096"``); empty when it is unset or empty.

    Raises:
        ValueError: an entry that is not an integer >= 2 (a one-token step is a decode step: the decode graph
            and the runner cover it)."""
    raw = os.environ.get(PREFILL_GRAPHS, "").strip()
    if not raw:
        return frozenset()
    lengths = set()
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 2:
            raise ValueError(f"{PREFILL_GRAPHS} must be comma-separated token counts >= 2 (e.g. '4096'), got "
                             f"{raw!r}: {part!r} is not one")
        lengths.add(int(part))
    return frozenset(lengths)


def stand_in_masks() -> bool:
    """Whether generate()'s prefill steps may get a stand-in full-attention mask (``UNIMEM_STAND_IN_MASKS`` is
    not ``0``; ``unimem_compile.hf.masks``)."""
    return os.environ.get(STAND_IN_MASKS) != "0"


def mla_decode_kernel() -> str | None:
    """The ``UNIMEM_MLA_DECODE_KERNEL`` override of ``mla_decode``'s stage-1 form (unchecked here: the
    launcher refuses a value that is not one of its kernels), or None when it is unset or empty."""
    return os.environ.get(MLA_DECODE_KERNEL) or None


def tp_timeout_s() -> float:
    """Seconds a tensor-parallel host-side check waits for the other ranks (``UNIMEM_TP_TIMEOUT``, default
    :data:`TP_TIMEOUT_DEFAULT_S`).

    Raises:
        ValueError: the variable is set to something that is not a positive, finite number."""
    raw = os.environ.get(TP_TIMEOUT)
    if not raw:
        return TP_TIMEOUT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{TP_TIMEOUT} must be a positive number of seconds, got {raw!r}")
    return value


@contextlib.contextmanager
def overridden(name: str, value: str):
    """Set the environment variable ``name`` to ``value`` inside the block and put back what the caller had
    (its value, or unset) after it, also when the block raises: an A/B column of a benchmark
    (``with overridden(KDA_GRAPHS, "0"): ...``) leaves a whole run's own setting as it found it. Every
    variable here is read per call, so the override takes effect at once."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def triton_interpret() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), e.g. on CPU tensors in CI."""
    return os.environ.get("TRITON_INTERPRET") == "1"
