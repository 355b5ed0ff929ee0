"""One rank of a tensor-parallel model: its process groups, and the host-side checks that keep the ranks in
agreement (docs/design.md section 9.3).

Every rank of a tensor-parallel model runs the same program on the same inputs; the collectives in the
compiled graphs then pair up. What could make ranks diverge is checked on the host, at the points where a
rank could otherwise fail alone and leave the others waiting in a collective:

* ``compile()``: each rank runs its checks, then the ranks exchange the outcome and a fingerprint of the
  launch (model class, config, parameter names, shapes and per-tensor sums, options, versions) and every
  rank raises if any rank failed or any fingerprint differs; a second exchange agrees on the arena budget
  (a fraction of free memory resolves per rank: every rank takes the smallest).
* each ``generate()`` call: the same exchange of the call's checks and a digest of its arguments, which also
  carries rank 0's random-number-generator states to every rank, so sampling draws the same tokens.
* under ``UNIMEM_DEBUG=1``, every step: the outcome of the step's preparation (a rank whose pool is full
  says so) and a digest of the pool's tables and the cache's page table and slots. Without it, a rank that
  fails alone inside the generation loop leaves the others in the step's collectives until the default
  group's own timeout (an exchange per step costs a host round trip the decode loop cannot afford).

These exchanges run on a gloo group of the same ranks (CPU, ``all_gather_object``) with a timeout of
``UNIMEM_TP_TIMEOUT`` seconds (default 300), apart from the default group that the model's collectives
use: a rank that never arrives makes the others raise after that time instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import env
from ..errors import RankMismatch, UnsupportedModel
from .collectives import gather_hook, reduce_hook
from .plan import TensorParallelPlan, apply_plan, plan_model

__all__ = ["TensorParallel"]


@dataclasses.dataclass
class TensorParallel:
    """This rank's part in a tensor-parallel model (``model.unimem.tensor_parallel``).

    Attributes:
        group: the process group the model's collectives run on (torch.distributed's default group).
        checks: a gloo group of the same ranks for the host-side checks, with a timeout of
            ``timeout_s``.
        rank, world_size: this rank and the number of ranks (the tensor-parallel degree).
        timeout_s: seconds a host-side check waits for the other ranks.
        plan: the :class:`~unimem_compile.tp.plan.TensorParallelPlan` applied to the model (None before
            :meth:`plan_for`).
    """

    group: Any
    checks: Any
    rank: int
    world_size: int
    timeout_s: float
    plan: TensorParallelPlan | None = None

    @classmethod
    def connect(cls) -> TensorParallel:
        """This rank's :class:`TensorParallel` over torch.distributed's default process group. Every rank
        must call it (it creates the gloo group of the checks, a collective).

        Raises:
            UnsupportedModel: torch.distributed is not available or its default process group is not
                initialised.
            ValueError: ``UNIMEM_TP_TIMEOUT`` is not a positive number of seconds.
            RankMismatch: the other ranks did not call it within ``UNIMEM_TP_TIMEOUT`` seconds.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedModel(
                "tensor_parallel=True needs torch.distributed's default process group: start one process per "
                "rank (torchrun --nproc-per-node N ...) and call torch.distributed.init_process_group() "
                "(backend 'nccl' for CUDA models, 'gloo' for CPU models) before compile()")
        timeout = env.tp_timeout_s()
        try:
            checks = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:  # the store's wait timeout (DistStoreError is a RuntimeError)
            raise RankMismatch(
                f"compile(tensor_parallel=True): rank {dist.get_rank()} waited {timeout:g} s ({env.TP_TIMEOUT}) for "
                f"all {dist.get_world_size()} ranks to enter compile() and they did not: a rank failed or stopped "
                f"before it, or the ranks do not run the same program ({type(e).__name__}: {e})") from e
        return cls(dist.group.WORLD, checks, dist.get_rank(), dist.get_world_size(), timeout)

    # ------------------------------------------------------------------ the exchange every check uses
    def agree(self, step: str, fn: Callable[[], tuple[Any, Any]]) -> tuple[Any, list]:
        """Run ``fn`` on this rank, then exchange its outcome with every rank.

        Args:
            step: what is being checked, for messages ("compile", "generate()").
            fn: returns ``(result, payload)``: ``result`` stays on this rank, ``payload`` (picklable) goes to
                every rank.

        Returns:
            ``(result, payloads)``, ``payloads[r]`` being rank r's payload.

        Raises:
            the exception ``fn`` raised, on the rank where it raised, after the exchange; RankMismatch on
            every other rank, naming the ranks that failed and their errors; RankMismatch when the other
            ranks did not arrive within ``timeout_s``.
        """
        error = None
        try:
            result, payload = fn()
        except Exception as e:  # noqa: BLE001 - every kind is reported to the other ranks, then re-raised
            error, result, payload = e, None, None
        outcome = None if error is None else f"{type(error).__name__}: {error}"
        gathered: list = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, (outcome, payload), group=self.checks)
        except RuntimeError as e:  # gloo's timeout (DistBackendError is a RuntimeError)
            raise RankMismatch(
                f"{step}: rank {self.rank} waited {self.timeout_s:g} s ({env.TP_TIMEOUT}) for the other ranks "
                f"to reach the same check and they did not: a rank failed or stopped before it, or the ranks do "
                f"not run the same program ({type(e).__name__}: {e})") from e
        if error is not None:
            raise error
        failed = [(r, o) for r, (o, _) in enumerate(gathered) if o is not None]
        if failed:
            raise RankMismatch(f"{step}: " + "; ".join(f"rank {r} failed: {o}" for r, o in failed)
                               + f"; rank {self.rank} stops too, so that no rank waits in a collective")
        return result, [p for _, p in gathered]

    def _require_same(self, step: str, payloads: list[dict]) -> None:
        """RankMismatch (on every rank alike) naming what differs between any rank's payload and rank 0's."""
        problems = []
        for r, payload in enumerate(payloads[1:], 1):
            problems += [f"rank {r}'s {d}" for d in _differences(payloads[0], payload, r)]
        if problems:
            raise RankMismatch(f"{step}: the ranks differ: " + "; ".join(problems[:6])
                               + ("; ..." if len(problems) > 6 else "")
                               + ". Every rank must load the same model and weights and pass the same options "
                               "and inputs")

    # ------------------------------------------------------------------ compile
    def check_launch(self, model, check: Callable[[], Any]) -> Any:
        """Run ``compile()``'s local ``check`` (it returns the checked options), then agree on it and on the
        launch's fingerprint (:func:`launch_fingerprint`) with every rank; returns ``check``'s result.

        Raises:
            what ``check`` raised (this rank), RankMismatch (another rank failed, or a fingerprint differs).
        """
        def run():
            options = check()
            return options, launch_fingerprint(model, options)

        options, payloads = self.agree("compile(tensor_parallel=True)", run)
        self._require_same("compile(tensor_parallel=True)", payloads)
        return options

    def plan_for(self, model) -> TensorParallelPlan:
        """Plan ``model``'s shards over :attr:`world_size` ranks (:func:`~unimem_compile.tp.plan.plan_model`:
        it raises GeometryError for a world size that does not divide the heads or an intermediate size);
        nothing is changed yet."""
        self.plan = plan_model(model, self.world_size)
        return self.plan

    def check_device(self, device: torch.device) -> None:
        """Refuse a model on a device the default group's backend cannot run collectives on.

        Raises:
            UnsupportedModel: an NCCL group with a model that is not on a CUDA device."""
        backend = dist.get_backend(self.group)
        if backend == "nccl" and device.type != "cuda":
            raise UnsupportedModel(f"the default process group's backend is nccl, which runs collectives on CUDA "
                                   f"tensors only, but the model is on {device}: use backend='gloo' for CPU models")

    def shard(self, model) -> TensorParallelPlan:
        """Apply this rank's shard of :attr:`plan` (made by :meth:`plan_for`) to ``model`` in place; the
        traced collectives run on :attr:`group`."""
        apply_plan(model, self.plan, self.rank, reduce_hook(self.group), gather_hook(self.group))
        model._unimem_sharded = True  # a compile() failing after this point leaves a model not to shard again
        return self.plan

    def agree_budget(self, layout_fn: Callable[[], Any], relayout: Callable[[int], Any]) -> Any:
        """The arena layout every rank uses: ``layout_fn()`` on each rank (it raises for a budget this rank's
        device cannot hold), then, when the budgets differ (a fraction of each rank's free memory),
        ``relayout(smallest budget)`` on every rank, so all ranks' pools have the same pages and slots."""
        def run():
            layout = layout_fn()
            return layout, layout.memory_budget

        layout, budgets = self.agree("the arena budget", run)
        smallest = min(budgets)
        return layout if layout.memory_budget == smallest else relayout(smallest)

    # ------------------------------------------------------------------ generate
    def agree_generate(self, check: Callable[[], Any], args: tuple, kwargs: dict, device: torch.device):
        """Run generate()'s local ``check`` (it returns the checked call), then agree with every rank on its
        outcome and on a digest of the call's arguments and the model's ``generation_config``; every rank
        then takes rank 0's random-number generator states (CPU and ``device``), so sampled tokens are the
        same on every rank.

        Raises:
            what ``check`` raised (this rank); RankMismatch (another rank failed its check, or was called
            with other arguments). A call refused here has released the cache it created.
        """
        def run():
            call = check()
            # the model's own generation_config too: generate() falls back on it for what the call leaves out
            digest = call_digest((args, kwargs, getattr(call.model, "generation_config", None)), {})
            return call, {"arguments": digest, "rng": _rng_states(device)}

        call, payloads = self.agree("generate()", run)
        try:
            self._require_same("generate()", [{"arguments": p["arguments"]} for p in payloads])
        except RankMismatch:
            if not call.passed:
                call.cache.release()
            raise
        _set_rng_states(payloads[0]["rng"], device)
        return call

    def agree_step(self, prepare: Callable[[], None], pool, cache) -> None:
        """``UNIMEM_DEBUG=1``: run ``prepare`` (the cache's eager step preparation) and agree with every rank
        on its outcome and on a digest of the pool's tables and ``cache``'s page table, lengths and slots
        afterwards: every rank must allocate the same ids. A rank whose preparation fails (a full pool) is
        then reported to the others instead of leaving them in the step's collectives.

        Raises:
            what ``prepare`` raised (this rank); RankMismatch: another rank's preparation failed, or a
                rank's tables differ from rank 0's."""
        step = "a step's page tables (UNIMEM_DEBUG=1)"
        _, payloads = self.agree(step, lambda: (prepare(), {"page tables": table_digest(pool, cache)}))
        self._require_same(step, payloads)


# ---------------------------------------------------------------------------------------------- digests
def launch_fingerprint(model, options) -> dict:
    """What must be equal on every rank at ``compile(tensor_parallel=True)``: the model class, its config,
    every parameter's name, shape and dtype, per-parameter float64 sum and L2 norm (a digest of the weights;
    one reduction per tensor), the options, the device type and the torch / transformers versions."""
    import transformers

    params = list(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        digest = [torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
                  for _, p in params]
        digest = torch.stack(digest).cpu().tolist() if digest else []
    return {
        "model class": type(model).__name__,
        "config": model.config.to_dict(),
        "parameters": [(name, tuple(p.shape), str(p.dtype)) for name, p in params],
        "weights": dict(zip((name for name, _ in params), map(tuple, digest))),
        "options": dataclasses.asdict(options),
        "device type": next(model.parameters()).device.type,
        "versions": (torch.__version__, transformers.__version__),
    }


def _same(a, b) -> bool:
    """Equality where NaN equals NaN (weight digests of a model holding NaN must still compare equal)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


#: payload keys that hold a digest: a difference is named, the hashes are not shown
_DIGESTS = ("arguments", "page tables")


def _differences(ref: dict, other: dict, rank: int) -> list[str]:
    """What differs between rank 0's payload ``ref`` and rank ``rank``'s ``other``, one entry per key (for
    dicts, the first three differing sub-keys with both values)."""
    out = []
    for key in ref:
        a, b = ref[key], other.get(key)
        if key in _DIGESTS:
            if a != b:
                out.append(f"{key} differ from rank 0's")
        elif isinstance(a, dict) and isinstance(b, dict):
            keys = [k for k in {**a, **b} if not _same(a.get(k), b.get(k))]
            if keys:
                shown = ", ".join(k if key == "weights" else
                                  f"{k} ({_short(a.get(k))} on rank 0, {_short(b.get(k))} on rank {rank})"
                                  for k in keys[:3])
                out.append(f"{key} differ in {len(keys)} entr{'y' if len(keys) == 1 else 'ies'}: {shown}"
                           + (", ..." if len(keys) > 3 else ""))
        elif not _same(a, b):
            out.append(f"{key} differs ({_short(a)} on rank 0, {_short(b)} on rank {rank})")
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _feed(h, obj) -> None:
    """Feed ``obj`` into the hash ``h``: tensors by dtype, shape and bytes, GenerationConfigs by their JSON,
    containers item by item, plain values by repr, anything else (a logits processor, a streamer, a cache)
    by its type only (its repr may hold a memory address, which differs between ranks)."""
    from transformers import GenerationConfig

    if isinstance(obj, torch.Tensor):
        h.update(f"tensor {obj.dtype} {tuple(obj.shape)}".encode())
        h.update(obj.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, GenerationConfig):
        h.update(obj.to_json_string(use_diff=False).encode())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            h.update(f"key {key!r}".encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__} {len(obj)}".encode())
        for item in obj:
            _feed(h, item)
    elif obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        h.update(repr(obj).encode())
    else:
        h.update(f"object {type(obj).__module__}.{type(obj).__qualname__}".encode())


def call_digest(args: tuple, kwargs: dict) -> str:
    """SHA-256 of a generate() call's arguments (see :func:`_feed`): equal on ranks called alike."""
    h = hashlib.sha256()
    _feed(h, (args, kwargs))
    return h.hexdigest()


def table_digest(pool, cache) -> str:
    """SHA-256 of the pool's id tables and watermarks and of ``cache``'s page table, row lengths and slots
    (host copies: no device synchronisation)."""
    h = hashlib.sha256()
    alloc = pool.allocator
    for side in (alloc.kv, alloc.state):
        h.update(side.v2p.tobytes())
    h.update(repr((alloc.kv_watermark, alloc.state_watermark, list(cache.slots))).encode())
    if cache.page_tables is not None:
        h.update(repr((cache.page_tables.rows, cache.page_tables.lengths)).encode())
    return h.hexdigest()


def _rng_states(device: torch.device) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
