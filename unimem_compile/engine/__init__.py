"""Continuous batching on the unified pool (docs/engine.md): the FCFS scheduler over a memory-system
interface (:mod:`.scheduler`, :mod:`.memory`), the engine that runs it on a compiled model through the decode
runner (:mod:`.engine`), and transformers' manager API (:mod:`.manager`, :mod:`.api`)."""

from .api import generate_batch, init_continuous_batching
from .engine import (DEFAULT_MAX_PREFILL_ROWS, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_RESERVE_FRACTION, Engine,
                     EngineRequest, Phase)
from .manager import REQUEST_SETTINGS, ContinuousBatchingManager, GenerationOutput, QueueFull, RequestStatus
from .memory import MemorySystem, PoolMemory, QuotaMemory
from .scheduler import Scheduler

__all__ = [
    "DEFAULT_MAX_PREFILL_ROWS", "DEFAULT_MAX_PREFILL_TOKENS", "DEFAULT_RESERVE_FRACTION", "REQUEST_SETTINGS",
    "ContinuousBatchingManager", "Engine", "EngineRequest", "GenerationOutput", "MemorySystem", "Phase", "PoolMemory",
    "QueueFull", "QuotaMemory", "RequestStatus", "Scheduler", "generate_batch", "init_continuous_batching",
]
