"""UnifiedCache: a transformers ``Cache`` whose MLA rows and KDA states live in one unimem arena.

One cache serves one ``generate()`` call of ``batch_size`` rows. Its layers are built on transformers' own
layer bases (``CacheLayerMixin`` for MLA layers, ``LinearAttentionCacheLayerMixin`` for KDA layers) so the
library's type checks (which layers size the mask, ``is_linear``) keep working, on transformers 5.17 and
5.24 alike (notes/hf-cache.md).

Everything that allocates or computes ids happens EAGERLY in :meth:`UnifiedCache.prepare_step`, which the
wrapper of ``model.prepare_inputs_for_generation`` calls before every forward. The compiled forward sees
only stable-shape tensors: the arena, the tables and the step metadata of the
:class:`~unimem_compile.hf.runtime.StepBuffers` every cache of one batch size shares.

A cache belongs to one compiled model's :class:`~unimem_compile.hf.runtime.UnimemHandle` and reaches the
model's runtime state only through the handle's methods (step buffers, returning rows, the orphan queue);
this module never imports the runtime.

Semantics (like transformers' StaticCache): history position ``j`` is logical position ``j``, left pads
included; ``get_mask_sizes`` returns ``(max_seq_len, 0)``; ``get_seq_length`` returns the logical length
before the current step as a 0-d tensor (a Python int would make Dynamo recompile every step). Left pads
are never stored: their locations are -1, they are not counted in ``kv_len``, and ``mla_gather`` places a
row's first token at its pad count (``out_offset``).
"""

from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from .. import env, ops  # noqa: F401  (registers the torch.ops.unimem.* this cache calls)
from ..errors import GeometryError, PoolExhausted, UnsupportedModel
from ..ops.geometry import MLAGeometry
from ..pool import PageTables, UnifiedPool
from ..pool.staging import upload
from .adapters import ModelAdapter

if TYPE_CHECKING:
    from .runtime import UnimemHandle

__all__ = ["UnifiedCache"]


class _GatherOnRead:
    """``layer.conv_states[0]`` / ``layer.recurrent_states[0]`` for transformers 5.17, which reads the
    states directly from the layer instead of calling ``cache.get_conv_state``."""

    def __init__(self, read):
        self._read = read

    def __getitem__(self, state_idx: int) -> torch.Tensor:
        if state_idx != 0:
            raise IndexError(f"a unimem KDA layer holds one state, asked for state {state_idx}")
        return self._read()


class MLACacheLayer(CacheLayerMixin):
    """One MLA layer: latent rows ``[kv_nope | k_rot]`` in page envelope layer ``kv_layer`` (``geometry``: the
    MLA ops' geometry arguments for that layer)."""

    is_compileable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: UnifiedCache, kv_layer: int):
        super().__init__()
        self.cache = cache
        self.kv_layer = kv_layer
        self.geometry = MLAGeometry.of(cache.adapter.kv_spec, cache.page_size, kv_layer)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache._mla_update(self.geometry, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.max_seq_len, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.cache.seq_length

    def get_max_length(self) -> int:
        return self.cache.max_seq_len

    def get_max_cache_shape(self) -> int:
        return self.cache.max_seq_len

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search (reorder_cache) is not supported by the unimem cache yet")

    def __repr__(self) -> str:
        return f"MLACacheLayer(kv_layer={self.kv_layer})"


class KDACacheLayer(LinearAttentionCacheLayerMixin):
    """One KDA layer: its conv and recurrent state sections in every row's slot (state layer ``state_layer``).

    The mixin's ``__init__`` is not called: its ``conv_states`` / ``recurrent_states`` dicts become
    read-through views of the arena here.
    """

    is_compileable = True
    supports_early_init = False

    def __init__(self, cache: UnifiedCache, state_layer: int):
        self.cache = cache
        self.state_layer = state_layer
        spec = cache.pool.layout.state
        self.conv_offset = spec.conv_offset(state_layer)
        self.recurrent_offset = spec.recurrent_offset(state_layer)
        self.conv_shape = list(spec.layers[state_layer].conv.shape)
        self.conv_dtype = spec.layers[state_layer].conv.dtype
        self.recurrent_shape = list(spec.layers[state_layer].recurrent.shape)
        self.number_of_states = 1
        self.is_conv_states_initialized = {0: True}
        self.is_recurrent_states_initialized = {0: True}
        # constant True: every slot is zeroed when allocated, and a zero state is "no history", so fresh
        # and continuing rows share one code path (and Dynamo never guards on a flipping bool)
        self.has_previous_state = {0: True}
        self.conv_kernel_size = {0: self.conv_shape[-1]}
        self.device = cache.pool.device
        self.dtype = self.conv_dtype
        self.record_past = False
        # the conv state to store at the end of the layer (update_recurrent_state, which every KDA forward
        # calls last): in a decode step the gathered state, which transformers' conv update overwrites in
        # place; in a prefill step the last K columns of the new input
        self._conv_gathered: torch.Tensor | None = None

    # ---- reads
    def read_conv(self) -> torch.Tensor:
        c = self.cache
        self._conv_gathered = torch.ops.unimem.state_gather(
            c.pool.arena, c.pool.s_v2p, c.buffers.slot_ids, self.conv_offset, c.pool.layout.slot_bytes,
            self.conv_shape, self.conv_dtype,
        )
        return self._conv_gathered

    def read_recurrent(self) -> torch.Tensor:
        c = self.cache
        return torch.ops.unimem.state_gather(
            c.pool.arena, c.pool.s_v2p, c.buffers.slot_ids, self.recurrent_offset, c.pool.layout.slot_bytes,
            self.recurrent_shape, torch.float32,
        )

    @property
    def conv_states(self) -> _GatherOnRead:
        return _GatherOnRead(self.read_conv)

    @property
    def recurrent_states(self) -> _GatherOnRead:
        return _GatherOnRead(self.read_recurrent)

    # ---- writes
    def lazy_initialization(self, *args, **kwargs) -> None:
        return None

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Prefill: ``conv_states [B, C, S]`` are this step's raw columns. Returns the previous state
        followed by them ``[B, C, K + S]`` (the conv's left context); the last K columns are stored by
        :meth:`update_recurrent_state`. Writing them here, before the layer's recurrent state is read, let
        Inductor schedule that read after the write, which made it copy the whole arena to keep the old
        bytes readable."""
        previous = self._conv_gathered if self._conv_gathered is not None else self.read_conv()
        full = torch.cat([previous, conv_states.to(previous.dtype)], dim=-1)
        self._conv_gathered = full[..., -self.conv_shape[-1]:].contiguous()
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        c = self.cache
        slot_bytes = c.pool.layout.slot_bytes
        torch.ops.unimem.state_scatter(
            c.pool.arena, c.pool.s_v2p, c.buffers.slot_ids, recurrent_states.to(torch.float32).contiguous(),
            self.recurrent_offset, slot_bytes,
        )
        if self._conv_gathered is not None:
            torch.ops.unimem.state_scatter(
                c.pool.arena, c.pool.s_v2p, c.buffers.slot_ids, self._conv_gathered, self.conv_offset, slot_bytes
            )
            self._conv_gathered = None
        return recurrent_states

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search (reorder_cache) is not supported by the unimem cache yet")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop is not supported by the unimem cache")

    def __repr__(self) -> str:
        return f"KDACacheLayer(state_layer={self.state_layer})"


class UnifiedCache(Cache):
    """A transformers ``Cache`` over a unimem pool, for one batch of ``batch_size`` rows.

    Create it with ``model.unimem.new_cache(batch_size)`` (``generate()`` does this for you). Pages and
    slots are allocated step by step in :meth:`prepare_step` and returned by :meth:`release`. ``buffers``
    (a :class:`~unimem_compile.hf.runtime.StepBuffers` of ``batch_size`` rows) replaces the shared step
    buffers of that batch size: the decode runner's per-bucket caches read buffers only its graphs use.

    Raises:
        GeometryError: the batch is larger than ``max_batch_size``; a row would outgrow ``max_seq_len``;
            right padding or padding in the middle of a row.
        PoolExhausted: the pool cannot hold the step's pages or the batch's slots (nothing allocated).
    """

    @torch.inference_mode(False)  # tables made under inference_mode must stay writable outside it
    def __init__(self, handle: UnimemHandle, batch_size: int, *, buffers=None):
        with handle.generate_lock:  # it reclaims orphans into step buffers a running generate() may share
            self._init(handle, batch_size, buffers)

    def _init(self, handle: UnimemHandle, batch_size: int, buffers) -> None:
        if not 0 < batch_size <= handle.max_batch_size:
            raise GeometryError(f"batch size {batch_size} is outside [1, max_batch_size={handle.max_batch_size}]")
        self.handle = handle
        self.pool: UnifiedPool = handle.pool
        self.adapter: ModelAdapter = handle.adapter
        self.num_rows = batch_size
        self.max_seq_len = handle.max_seq_len
        self.page_size = self.pool.layout.page_size
        # the decode runner passes step buffers of its own (the ones its captured graphs read); every other
        # cache shares its batch size's buffers with the model's other caches of that size
        self.buffers = handle.step_buffers(batch_size) if buffers is None else buffers
        handle.reclaim_orphans()
        self.page_tables = None
        if self.adapter.kv_spec is not None:
            self.page_tables = PageTables(
                self.pool, batch_size, self.buffers.page_table.shape[1],
                out=(self.buffers.page_table, self.buffers.kv_len),
            )
            # PageTables cleared the shared tables: whichever cache was resident there must upload again
            self.buffers.resident = None
        self.slots: list[int] = []  # mutated in place: the orphan watch holds the same list
        self._out_offset = torch.zeros(batch_size, dtype=torch.int32)  # host copy of the left pads
        self._watch()
        self.logical_len = 0
        self.seq_length = torch.zeros((), dtype=torch.int64)  # logical length before the current step
        self.write_loc = self.buffers.decode_loc
        layers: list = [None] * self.adapter.num_layers
        for kv_layer, i in enumerate(self.adapter.mla_layers):
            layers[i] = MLACacheLayer(self, kv_layer)
        for state_layer, i in enumerate(self.adapter.linear_layers):
            layers[i] = KDACacheLayer(self, state_layer)
        super().__init__(layers=layers)
        self.released = False
        self.released_because: str | None = None
        #: set by generate() on the caches it creates (never on a cache the caller passes): transformers may
        #: then read the stop flag one step late (see activate_past_recording / crop)
        self.defer_stop_check = False
        #: set by generate() when the caller passed no attention_mask: transformers then infers one from
        #: pad_token_id, and a padding error says so
        self.mask_hint: str | None = None
        #: set by generate() before its first step: that step reads the whole mask (a continuing call may
        #: bring pads anywhere); later one-token steps only append ones and skip the read (no host sync)
        self.call_start = False
        #: set by generate() for a call with prefill_chunk_size: the logical length its prompt ends at (None:
        #: the prompt is prefilled in one step). Until then a step may bring only the new tokens without a
        #: mask (transformers drops an all-ones mask), and a row may end a step with only pads (more left pads
        #: than a chunk)
        self.chunked_prefill_end: int | None = None
        #: (device mask, its host copy) of :meth:`remember_mask`: a step whose mask is a slice of it reads the host
        #: copy instead of waiting for the GPU to copy the mask back (None: every checked step reads it back)
        self._known_mask: tuple[torch.Tensor, torch.Tensor] | None = None
        #: (the current step's attention_mask, the host copy of its values that prepare_step checked) or None
        self._step_mask: tuple[torch.Tensor, torch.Tensor] | None = None
        #: set by prepare_step, cleared by the compiled forward: a forward without a prepared step is refused
        self.prepared = False
        #: set by the model's create_masks_for_generate (hf/masks.py) for a step whose full-attention mask is a
        #: stand-in, cleared by the compiled forward: ``f(cache)`` builds transformers' masks for the step
        #: (None: the step's mask is real)
        self.stand_in_masks = None
        self.undone_steps = 0
        #: True for a cache over rows another owner frees (:meth:`over_rows`)
        self.borrowed = False

    @classmethod
    def over_rows(cls, handle: UnimemHandle, pages: list[int], length: int, slot: int | None,
                  prompt_end: int) -> UnifiedCache:
        """A one-row cache over memory another owner holds (the serving engine's prefill of one request).

        Args:
            handle: the model's handle.
            pages: the row's virtual pages in token order; they must hold ``prompt_end`` tokens (the cache
                never allocates for a borrowed row: a step that would need a page raises GeometryError).
            length: tokens the row stores already (its earlier chunks).
            slot: the row's virtual state slot (None: a model without linear-attention layers).
            prompt_end: the logical length the row's prefill ends at (:attr:`chunked_prefill_end`: each step
                brings only its new tokens, without a mask).

        The cache never frees the row (``release`` forgets it, a collected cache returns nothing): the
        owner frees the pages and the slot.
        """
        cache = cls._borrowing(handle, [(pages, slot)], length)
        cache.logical_len = int(length)
        cache.seq_length.fill_(int(length))
        cache.chunked_prefill_end = int(prompt_end)
        return cache

    @classmethod
    def over_packed_rows(cls, handle: UnimemHandle, rows: list[tuple[list[int], int | None]]) -> UnifiedCache:
        """A cache of ``len(rows)`` fresh rows over memory another owner holds, for ONE left-padded prefill step
        of whole prompts (the serving engine packs short prompts into one forward).

        Args:
            handle: the model's handle.
            rows: per row ``(pages, slot)``: its virtual pages in token order, which must hold its prompt (the
                cache never allocates for a borrowed row: a step that would need a page raises GeometryError),
                and its virtual state slot (None for every row: a model without linear-attention layers).

        The step brings ``[B, W]`` tokens with a ``[B, W]`` mask whose leading zeros are each row's left pads,
        as ``generate()``'s first step of a left-padded batch; every row stores its own tokens from position
        0 of its pages. The cache never frees the rows (the owner does).

        Raises:
            GeometryError: no rows, more than ``max_batch_size``, or slots given for some rows only.
        """
        if not rows:
            raise GeometryError("over_packed_rows needs at least one row")
        slots = [slot for _, slot in rows]
        if any(s is None for s in slots) and any(s is not None for s in slots):
            raise GeometryError(f"every packed row needs a state slot or none does, got {slots}")
        return cls._borrowing(handle, rows, 0)

    @classmethod
    def _borrowing(cls, handle: UnimemHandle, rows: list[tuple[list[int], int | None]], length: int) -> UnifiedCache:
        """The borrowed cache of :meth:`over_rows` and :meth:`over_packed_rows`: one row per ``(pages, slot)``
        (copies of the owner's page lists; the slots as given, none when the first is None), each storing
        ``length`` tokens already, the orphan watch off (the owner frees), the tables uploaded."""
        cache = cls(handle, len(rows))
        cache._orphan_watch.detach()
        cache.borrowed = True
        pt = cache.page_tables
        if pt is not None:
            for b, (pages, _) in enumerate(rows):
                pt.rows[b] = list(pages)  # copies: the owner's lists are never extended nor emptied here
                if pages:
                    pt._host_table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
                pt.lengths[b] = int(length)
                pt._host_len[b] = int(length)
        if rows[0][1] is not None:
            cache.slots[:] = [int(slot) for _, slot in rows]
        # not resident: its first prepare_step uploads the tables and rows (_make_resident), then grow() the
        # lengths; a third upload in that step, through a ring of two staging buffers, would wait for the GPU
        cache.buffers.resident = None
        return cache

    def fingerprint(self) -> tuple:
        """What a step changes: (tokens cached, every row's stored length, the state slots). Equal before and
        after a failed generate() means the failure happened before any step touched the cache."""
        lengths = tuple(self.page_tables.lengths) if self.page_tables is not None else ()
        return self.logical_len, lengths, tuple(self.slots)

    def _watch(self) -> None:
        # Watch for this cache being garbage-collected without release(): the watch only queues its pages,
        # slots and buffers on the handle; the next cache created for the model, its next step, or
        # handle.reclaim_orphans() returns them.
        self._orphan_watch = weakref.finalize(self, self.handle.queue_orphan, self.page_tables, self.slots,
                                              self.buffers)

    def _make_resident(self) -> None:
        """Put this cache's tables into the shared step buffers if another cache of the same batch size
        used them since this cache's last step (a no-op otherwise: one pointer compare per step)."""
        buffers = self.buffers
        if buffers.resident is not None and buffers.resident() is self:
            return
        if self.page_tables is not None:
            self.page_tables.sync()  # the whole host page table and lengths, in stream order
        self._upload_rows()
        buffers.resident = weakref.ref(self)

    def _upload_rows(self) -> None:
        """This cache's state slots (-1 without any) and left pads into the shared step buffers."""
        buffers = self.buffers
        if self.slots:
            buffers.upload_slot_ids(torch.tensor(self.slots, dtype=torch.int64))
        else:
            buffers.slot_ids.fill_(-1)
        buffers.upload_out_offset(self._out_offset)

    # ------------------------------------------------------------------ eager step preparation
    def prepare_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Allocate and lay out this step's tokens. Called eagerly before each forward.

        The step is laid out from the whole sequence so far, ``total`` tokens per row: the mask's length
        when a mask is given, else ``input_ids``'s. Its last ``total - logical_len`` tokens are new.

        Args:
            input_ids: ``[B, total]``, every token so far (transformers' generate passes the whole sequence),
                or ``[B, total - logical_len]``, only the new tokens, with a mask over the whole sequence
                (transformers' chunked prefill passes each chunk with the mask up to its end, or with no
                mask when the prompt has no padding: inside a chunked prefill, see
                :attr:`chunked_prefill_end`, ``input_ids`` without a mask are the new tokens).
            attention_mask: ``[B, total]`` 2-D padding mask or None (no padding). Left pads only; a row's
                pads may continue into a later step only while the row has no token yet (a prompt with more
                pads than a prefill chunk).

        Raises:
            UnsupportedModel: the cache was released.
            GeometryError: a batch of another size; no new tokens; ``input_ids`` neither the whole sequence
                nor the new tokens; more than ``max_seq_len`` tokens; a mask of another shape, with padding
                that is not left padding, or changing what earlier steps stored; a row of padding only
                (allowed before the last chunk of a chunked prefill, :attr:`chunked_prefill_end`); a chunk
                past the prompt's end.
            PoolExhausted: the pool cannot hold the step's pages or the batch's slots (nothing allocated).
        """
        if self.released:
            why = f" ({self.released_because})" if self.released_because else ""
            raise UnsupportedModel(f"this UnifiedCache was released{why}; create a new one with "
                                   "model.unimem.new_cache()")
        batch, given = int(input_ids.shape[0]), int(input_ids.shape[1])
        if batch != self.num_rows:
            raise GeometryError(f"this cache holds {self.num_rows} rows, the step has {batch}")
        if attention_mask is not None and (attention_mask.dim() != 2 or int(attention_mask.shape[0]) != batch
                                           or int(attention_mask.shape[1]) < given):
            raise GeometryError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids {[batch, given]}")
        chunking = self.chunked_prefill_end is not None and self.logical_len < self.chunked_prefill_end
        if attention_mask is not None:
            total = int(attention_mask.shape[1])
        else:  # a chunk without a mask (no padding) brings only its new tokens
            total = self.logical_len + given if chunking else given
        new = total - self.logical_len
        if new <= 0:
            raise GeometryError(
                f"the step brings no new tokens: input_ids has {total} tokens per row and the cache holds "
                f"{self.logical_len} already; pass the whole sequence so far (the cached tokens, then the new ones), "
                "not only the new tokens")
        if given not in (total, new):
            raise GeometryError(
                f"input_ids has {given} tokens per row, the attention_mask {total} and the cache holds "
                f"{self.logical_len}: pass the whole sequence so far ({total} tokens) or only the {new} new ones")
        if total > self.max_seq_len:
            raise GeometryError(
                f"a row would reach {total} tokens (prompt + generated, pads included), more than "
                f"max_seq_len={self.max_seq_len}; compile with a larger max_seq_len"
            )
        if chunking and total > self.chunked_prefill_end:
            raise GeometryError(f"a prefill chunk would end at {total} tokens, past the prompt's "
                                f"{self.chunked_prefill_end}")
        self.handle.reclaim_orphans()  # memory of caches dropped unreleased goes back before this step allocates
        self._make_resident()
        # Reading the mask on the host synchronises the GPU, so a one-token decode step does not: generate()
        # only ever appends ones to it. The first step, multi-token steps and prefill chunks are checked (a
        # one-token chunk, prefill_chunk_size=1, may be a pad).
        mask = None
        if attention_mask is not None and (self.logical_len == 0 or new > 1 or self.call_start or chunking):
            host = self._host_mask(attention_mask)
            self._step_mask = (attention_mask, host)
            mask = host.to(torch.bool)
        else:
            self._step_mask = None
        self.call_start = False
        try:
            pads = self._step_pads(mask, total, pads_only_ok=chunking and total < self.chunked_prefill_end)
        except GeometryError as e:
            if self.mask_hint:
                raise GeometryError(f"{e} ({self.mask_hint})") from None
            raise
        if pads is None:  # the pads stay (every decode step): each row grows by `new`, no tensor work
            lengths = [n + new for n in self.page_tables.lengths] if self.page_tables is not None else []
        else:
            lengths = (total - pads.to(torch.int64)).tolist()
        if self.logical_len == 0:
            def first_allocation():
                if self.adapter.state_spec is not None and not self.borrowed:  # a borrowed row has its slot
                    self.slots[:] = self.pool.alloc_slots(batch)
                if self.page_tables is not None:
                    try:
                        self._write_locations(new, lengths)
                    except Exception:  # the step fails as a whole: give the slots back (not a borrowed row's)
                        if self.slots and not self.borrowed:
                            self.pool.free_slots(self.slots)
                            self.slots.clear()
                        raise

            self._allocate(first_allocation)
        elif self.page_tables is not None:
            self._allocate(lambda: self._write_locations(new, lengths))
        if pads is not None and (self.logical_len == 0 or not torch.equal(pads, self._out_offset)):
            self._out_offset.copy_(pads)
            self._upload_rows()
        self.seq_length.fill_(self.logical_len)
        self.logical_len = total
        self.prepared = True

    def remember_mask(self, mask: torch.Tensor | None, host: torch.Tensor | None = None) -> None:
        """Let later steps whose ``attention_mask`` is ``mask`` or a slice ``mask[:, :n]`` of it read its host
        copy: a step's pads are checked on the host, and reading a CUDA mask back waits for every kernel queued
        before it (once per prefill chunk without this). generate() remembers the call's mask for a chunked
        prefill; the engine the mask of a packed prefill.

        Args:
            mask: the ``[B, L]`` mask the steps will be given (kept referenced, so its memory cannot be handed to
                another tensor while remembered), or None to forget it (and the last step's mask).
            host: its host copy, equal to it in values (None: ``mask`` is read back once, now). Never checked
                against ``mask``: the caller guarantees they hold the same values.

        A slice is recognised by its storage: the same data pointer, dtype, device, rows and strides, and at
        most ``L`` columns. Anything else is read back as before. ``UNIMEM_ASYNC_UPLOADS=0`` reads every mask
        back (A/B runs).
        """
        if mask is None:
            self._known_mask = self._step_mask = None
            return
        if mask.dim() != 2:
            raise GeometryError(f"remember_mask takes a 2-D [B, L] mask, got shape {list(mask.shape)}")
        host = mask.detach().cpu() if host is None else host
        if tuple(host.shape) != tuple(mask.shape):
            raise GeometryError(f"the host copy has shape {list(host.shape)}, the mask {list(mask.shape)}")
        self._known_mask = (mask, host)

    def step_host_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The host copy (``[B, L]``, the mask's values) of the current step's mask that :meth:`prepare_step`
        checked, when ``attention_mask`` is that very tensor object; None otherwise (another tensor, a step whose mask was
        not read). Lets the step's mask builders (hf/masks.py) decide on the host what transformers decides
        by reading the mask back."""
        step = self._step_mask
        return step[1] if step is not None and attention_mask is step[0] else None

    def _host_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``attention_mask`` on the host (its values): a slice of the remembered host copy when it is a slice of
        the remembered mask (no device sync), else read back."""
        known = self._known_mask
        if known is not None and env.async_uploads():
            dev, host = known
            m = attention_mask
            if (m.data_ptr() == dev.data_ptr() and m.dtype == dev.dtype and m.device == dev.device
                    and m.dim() == 2 and m.shape[0] == dev.shape[0] and m.shape[1] <= dev.shape[1]
                    and m.stride() == dev.stride()):
                return host[:, :m.shape[1]]
        return attention_mask.detach().cpu()

    def _step_pads(self, mask: torch.Tensor | None, total: int, pads_only_ok: bool) -> torch.Tensor | None:
        """Every row's left pads after this step (int32 ``[B]``), checked against what earlier steps stored;
        ``pads_only_ok``: a row may still have no token after it (a prefill chunk before the prompt's last).

        A row that holds a token keeps its pads, and its mask must be those pads then ones. A row without a
        token yet (every position so far a pad) takes its pads from the mask, which must be zeros then ones
        and may not mark as a token a position an earlier step held as a pad. ``mask`` None: nothing new is
        known (a step without a mask, or a one-token step whose mask is not read): returns None, the pads
        stay (zeros on a first step).
        """
        if mask is None:
            return None if self.logical_len else torch.zeros_like(self._out_offset)
        stored = self.logical_len - self._out_offset.to(torch.int64)  # tokens each row holds so far
        positions = torch.arange(total)
        pads = (~mask).cumprod(-1).sum(-1)  # leading zeros of each row
        expected = positions[None, :] >= torch.where(stored > 0, self._out_offset.to(torch.int64), pads)[:, None]
        if not torch.equal(mask, expected):
            row = int(torch.nonzero((mask != expected).any(-1))[0])
            col = int(torch.nonzero(mask[row] != expected[row])[0])
            hint = f" ({self.mask_hint})" if self.mask_hint else ""
            if stored[row] > 0:
                raise GeometryError(
                    f"padding after the first step (right padding or mid-sequence pads) is not supported: row "
                    f"{row}'s mask is {int(mask[row, col])} at position {col}, where the row has "
                    f"{int(self._out_offset[row])} left pads and {self.logical_len} cached tokens{hint}")
            raise GeometryError(f"only left padding is supported: row {row} has a pad at position {col}, after "
                                f"its first token at position {int(pads[row])}")
        if self.logical_len and bool((pads < self.logical_len).logical_and(stored == 0).any()):
            row = int(torch.nonzero((pads < self.logical_len) & (stored == 0))[0])
            raise GeometryError(f"row {row}'s mask marks position {int(pads[row])} as a token, which an earlier "
                                f"step of this cache held as a left pad")
        if not pads_only_ok and bool((pads == total).any()):
            row = int(torch.nonzero(pads == total)[0])
            raise GeometryError(f"row {row} of the batch consists of padding only ({total} pads)")
        return pads.to(torch.int32)

    def _allocate(self, step) -> None:
        """Run ``step`` (an allocation that raises PoolExhausted having allocated nothing); when the pool is
        full, collect garbage once: caches dropped without release() inside reference cycles hold their
        pages and slots until the cycle collector runs. Retry if that reclaimed any."""
        try:
            step()
        except PoolExhausted:
            gc.collect()
            if not self.handle.reclaim_orphans():
                raise
            step()
            # a reclaimed cache of this batch size shared our step buffers: returning its rows emptied their
            # page table and slot ids (resident = None), so upload ours again (a no-op otherwise)
            self._make_resident()

    def _write_locations(self, new: int, new_lengths: list[int]) -> None:
        pt = self.page_tables
        if self.borrowed and pt.pages_needed(range(self.num_rows), new_lengths):
            row = next(b for b in range(self.num_rows) if pt.pages_needed([b], [new_lengths[b]]))
            raise GeometryError(f"borrowed row {row} holds {len(pt.rows[row])} pages of {self.page_size} tokens, the "
                                f"step needs {new_lengths[row]} tokens: its owner allocates, the cache does not")
        old = list(pt.lengths)
        pt.grow(range(self.num_rows), new_lengths)
        if new == 1 and all(n - o == 1 for n, o in zip(new_lengths, old)):
            # one token per row (a decode step): located in one vectorised lookup, uploaded asynchronously
            loc = pt.token_locations(torch.tensor(old, dtype=torch.int64))
        else:
            loc = torch.full((self.num_rows, new), -1, dtype=torch.int64)  # pads: -1
            for b in range(self.num_rows):
                count = new_lengths[b] - old[b]
                if count:
                    loc[b, new - count:] = pt.locations(b, old[b], count)
        if new == 1:  # the decode graph reads the static decode_loc buffer
            self.buffers.upload_decode_loc(loc.reshape(self.num_rows, 1))
            self.write_loc = self.buffers.decode_loc
            return
        self.write_loc = upload(loc, self.pool.device)  # pinned, no stream sync

    # ------------------------------------------------------------------ the decode runner's side
    @property
    def left_pads(self) -> torch.Tensor:
        """Each row's left pads (int32 ``[B]``, host; set by the first step): where ``mla_gather`` puts a
        row's first token. Read it, never write it."""
        return self._out_offset

    def adopt_device_steps(self, logical_len: int) -> None:
        """After the decode runner ran steps of this cache on the device: it advanced the rows' lengths
        there and reported each one through ``page_tables.set_length``; ``logical_len`` is the length the
        rows reach now, left pads included (the next step's first position).

        The runner's page-table edits also refreshed this cache's copy in the shared step buffers, which
        another cache of this batch size may hold: nobody's tables are resident there now, so the next
        step of any cache of this size uploads its own first.

        Raises:
            GeometryError: ``logical_len`` below the cached length (a row never shrinks).
        """
        if logical_len < self.logical_len:
            raise GeometryError(f"the decode runner reports {logical_len} tokens per row, but this cache holds "
                                f"{self.logical_len} already")
        self.logical_len = logical_len
        self.seq_length.fill_(logical_len)
        self.buffers.resident = None

    # ------------------------------------------------------------------ traced: MLA read/write
    def _mla_update(self, geometry: MLAGeometry, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        pool = self.pool
        B, _, S, R = kv_nope.shape
        Dr = k_rot.shape[-1]
        torch.ops.unimem.mla_kv_write(
            pool.arena, pool.v2p, self.write_loc.reshape(-1), kv_nope.reshape(B * S, R), k_rot.reshape(B * S, Dr),
            *geometry.args(),
        )
        full = torch.ops.unimem.mla_gather(
            pool.arena, pool.v2p, self.buffers.page_table, self.buffers.kv_len, self.buffers.out_offset,
            self.max_seq_len, *geometry.args(),
        ).to(kv_nope.dtype)
        return full[:, None, :, :R], full[:, None, :, R:]

    # ------------------------------------------------------------------ the Cache API transformers calls
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def _kda(self, layer_idx: int) -> KDACacheLayer:
        layer = self.layers[layer_idx]
        if not isinstance(layer, KDACacheLayer):
            raise UnsupportedModel(f"layer {layer_idx} is not a linear-attention layer in this cache")
        return layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._kda(layer_idx).read_conv()

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._kda(layer_idx).read_recurrent()

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._kda(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._kda(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.seq_length

    def get_query_offset(self, layer_idx: int = 0) -> torch.Tensor:
        return self.seq_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.max_seq_len, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_seq_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_seq_len

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self.num_rows

    @property
    def max_batch_size(self) -> int:
        return self.num_rows

    @property
    def max_cache_len(self) -> int:
        return self.max_seq_len

    def reset(self) -> None:
        """Free every page and slot and start over empty (the cache stays usable; a released cache becomes
        usable again)."""
        if self.released:
            self._watch()
        self._free()
        self.released = False
        self.released_because = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search (reorder_cache) is not supported by the unimem cache yet")

    # ------------------------------------------------------------------ release
    def _free(self) -> None:
        if self.borrowed:  # the owner frees the rows: only forget them
            if self.page_tables is not None:
                self.page_tables.rows = [[] for _ in range(self.num_rows)]
            self.slots.clear()
            self.buffers.resident = None
        else:
            self.handle.return_rows(self.page_tables, self.slots, self.buffers)  # under the model's generate lock
        self._out_offset.zero_()
        self._known_mask = self._step_mask = None  # no reference to a caller's mask outlives the rows
        self.logical_len = 0
        self.seq_length.fill_(0)
        self.write_loc = self.buffers.decode_loc

    def release(self, reason: str | None = None) -> None:
        """Return every page and slot to the pool; the cache cannot be used afterwards (idempotent).

        ``reason`` (optional) is quoted by the error a later use of the cache raises."""
        if self.released:
            return
        self._free()
        self._orphan_watch.detach()
        self.released = True
        self.released_because = reason

    # ------------------------------------------------------------------ transformers' deferred stop check
    def activate_past_recording(self) -> None:
        """Called by transformers' ``DeferredStopCheck`` (host reads the stop flag one step late). Only a
        cache that generate() created for one call allows it (``defer_stop_check``): it is released when
        the call returns, so the one extra step it may run is never rolled back.

        Raises:
            NotImplementedError: any other cache (recurrent states cannot be rolled back).
        """
        if not self.defer_stop_check:
            raise NotImplementedError("the unimem cache cannot record past states to roll a step back "
                                      "(its recurrent states are updated in place)")

    def crop(self, max_length: int) -> None:
        """``crop(0)`` is a no-op; ``crop(-n)`` (transformers undoing the extra step of a deferred stop
        check) is accepted on a ``defer_stop_check`` cache only, and only counted in ``undone_steps``: the
        cache is released when its generate() returns, so the step's tokens are never read.

        Raises:
            NotImplementedError: any other crop (the recurrent states cannot be rolled back).
        """
        if max_length == 0:
            return
        if max_length < 0 and self.defer_stop_check:
            self.undone_steps += -max_length
            return
        raise NotImplementedError(f"crop({max_length}) is not supported by the unimem cache (its recurrent "
                                  "states cannot be rolled back)")

    def finish_generate(self) -> None:
        """End of a generate() call that used this cache: every cached token now counts as past, so
        ``get_seq_length()`` is the number of tokens cached and a later ``generate()`` given this cache and
        the returned sequences continues from them (transformers feeds only the tokens past that length)."""
        self.seq_length.fill_(self.logical_len)

    def __repr__(self) -> str:
        return (f"UnifiedCache(batch_size={self.num_rows}, max_seq_len={self.max_seq_len}, "
                f"logical_len={self.logical_len}, slots={self.slots})")
