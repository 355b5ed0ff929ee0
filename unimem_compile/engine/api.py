"""``model.generate_batch`` and ``model.init_continuous_batching`` on a compiled model (transformers' names
and defaults, 5.24; ``compile()`` installs them on the model instance)."""

from __future__ import annotations

import functools
import logging

import torch

from .manager import ContinuousBatchingManager, GenerationOutput, _prompt_list

__all__ = ["install", "generate_batch", "init_continuous_batching"]

logger = logging.getLogger(__name__)

# transformers' arguments the unimem engine does not take: refused by name when given a non-default value
_REFUSED = {"continuous_batching_config": None, "workload_hints": None, "persistent_manager": False}


def _refuse(kwargs: dict, where: str) -> None:
    for name, default in _REFUSED.items():
        if name in kwargs and kwargs[name] != default:
            raise NotImplementedError(f"{where}({name}=...) is transformers' own continuous batching option; the "
                                      f"unimem engine takes max_prefill_tokens, max_prefill_rows, reserve_fraction, "
                                      f"max_queue and memory instead (docs/engine.md)")
        kwargs.pop(name, None)


def init_continuous_batching(model, generation_config=None, **kwargs) -> ContinuousBatchingManager:
    """A :class:`~.manager.ContinuousBatchingManager` for ``model`` (not started: ``start()`` it, or use it
    as a context manager). Keywords: the manager's (``max_prefill_tokens``, ``max_prefill_rows``,
    ``reserve_fraction``, ``max_queue``, ``memory``); transformers' ``continuous_batching_config`` /
    ``workload_hints`` are refused by name."""
    _refuse(kwargs, "init_continuous_batching")
    return ContinuousBatchingManager(model, generation_config, **kwargs)


def generate_batch(model, inputs: list[list[int]], generation_config=None, record_timestamps: bool = False,
                   progress_bar: bool = False, warmup: bool = True, **kwargs) -> dict[str, GenerationOutput]:
    """Generate every prompt of ``inputs`` with continuous batching; returns ``{request id: GenerationOutput}``
    in input order (ids ``req_0``, ``req_1``, ...), each finished (or failed, with ``error``).

    Keywords: ``max_new_tokens`` (default: the generation config's), ``eos_token_id`` and the per-request
    settings of ``add_request`` (``seed``, ``stop_sequences``, ...: applied to every prompt alike), and the
    manager's (``max_prefill_tokens``, ``max_prefill_rows``, ``reserve_fraction``, ``memory``). ``warmup`` is accepted
    and does nothing (the runner builds its steps on first use). ``progress_bar``: a tqdm bar over the requests. An
    exception while it waits (Ctrl-C) cancels the requests still running, then propagates.

    Raises:
        ValueError: ``inputs`` not a list of prompts (a 2-D tensor, one flat list of ids, text).
        what ``add_request`` raises for a bad prompt (before any request runs).
    """
    _refuse(kwargs, "generate_batch")
    inputs = _prompt_list(inputs, "generate_batch")
    if not inputs:
        return {}
    names = ("max_prefill_tokens", "max_prefill_rows", "reserve_fraction", "memory")
    manager_kwargs = {k: kwargs.pop(k) for k in names if k in kwargs}
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    manager = ContinuousBatchingManager(model, generation_config, **manager_kwargs)
    ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps, **kwargs)
    results: dict[str, GenerationOutput] = {}
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc=f"Solving {len(ids)} requests", unit="request")
    done = False
    with torch.no_grad():
        manager.start()
        try:
            while len(results) < len(ids):
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
                elif out is None and not manager.is_running():
                    break
            done = True
        finally:  # an exception here (Ctrl-C) cancels the requests instead of waiting for them all
            manager.stop(block=True, hard_stop=not done)
            if bar is not None:
                bar.close()
    missing = [i for i in ids if i not in results]
    if missing:
        logger.error("generate_batch: requests %s returned no result", missing)
    return {i: results[i] for i in ids if i in results}


def install(model) -> None:
    """Attach ``generate_batch`` and ``init_continuous_batching`` to the compiled ``model`` instance."""
    model.generate_batch = functools.partial(generate_batch, model)
    model.init_continuous_batching = functools.partial(init_continuous_batching, model)
