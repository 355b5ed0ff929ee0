"""Per-row generation settings and bookkeeping as device tensors at fixed addresses.

A decode step captured in a CUDA graph reads every setting of every row from tensors that never move:
:class:`RowState` allocates them once, for ``max_rows`` rows, and the host changes a row only by writing
into them (stream-ordered, never synchronising). One graph therefore serves rows with different settings
(greedy next to sampled, different top-k / top-p / penalties / EOS lists), and a batching engine can put a
request into a free row, or take one out, between two replays while the other rows keep running.

Row ``i`` of every tensor is batch position ``i`` of the step: a step over a bucket of ``n`` rows reads
``RowState.view(n)``. A row that holds no request is *cleared*: ``finished`` is True, so a step leaves it
unchanged (it emits the pad token, writes no output and counts nothing); padded rows of a bucket are such
rows. :meth:`RowState.move_row` moves a request to another row (to keep the live rows at the front).

:class:`RowSettings` is one row's settings on the host, derived from a transformers ``GenerationConfig``
exactly as ``GenerationMixin.generate`` derives its logits processors and stopping criteria
(``_prepare_generated_length``, ``_prepare_special_tokens``, ``_get_logits_processor``,
``_get_stopping_criteria`` of transformers 5.x); settings the fused step does not implement are refused by
name (:func:`unsupported_settings`), so a caller can fall back to stock generate().
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..errors import GeometryError, UnimemError
from ..pool.allocator import as_int
from .rng import draw_seeds

__all__ = [
    "DEFAULT_MAX_EOS",
    "GenerationSettingError",
    "UnsupportedGenerationSetting",
    "RowSettings",
    "RowState",
    "Rows",
    "unsupported_settings",
]

DEFAULT_MAX_EOS = 8
"""EOS ids a row holds by default (``RowState(max_eos=...)``): chat models list 1-3, 8 leaves room."""

# GenerationConfig's global defaults (transformers' GenerationConfig._get_default_generation_params), which
# generate() fills into fields left None; tests/runner/test_rows.py checks this table against transformers.
_DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "min_length": 0,
    "max_length": 20,
}
# generate() adds the prompt length to a default max_length: 20 NEW tokens (_prepare_generated_length).
_DEFAULT_MAX_NEW_TOKENS = 20


class GenerationSettingError(UnimemError, ValueError):
    """A generation setting the runner cannot apply: a value out of range, or (subclass
    :class:`UnsupportedGenerationSetting`) a feature it does not fuse.

    Attributes:
        setting: the ``GenerationConfig`` attribute name (or RowSettings field) at fault.
        value: its value.
    """

    def __init__(self, message: str, *, setting: str, value):
        super().__init__(message)
        self.setting = setting
        self.value = value

    def __reduce__(self):  # keyword-only fields: pickling must pass them back by name
        return _rebuild_setting_error, (type(self), str(self), self.setting, self.value)


def _rebuild_setting_error(cls, message, setting, value):
    return cls(message, setting=setting, value=value)


class UnsupportedGenerationSetting(GenerationSettingError):
    """A ``GenerationConfig`` setting that changes tokens in a way the fused step does not implement
    (``setting`` names it); the caller should run stock generate() for this call."""


# (attribute, predicate that is True when the setting is active), in _get_logits_processor's /
# _get_stopping_criteria's / get_generation_mode's terms. Encoder-only settings are absent: transformers
# ignores them for decoder-only models.
_UNSUPPORTED: tuple[tuple[str, object], ...] = (
    ("num_beams", lambda v: v is not None and v != 1),
    ("penalty_alpha", lambda v: v is not None and v > 0),
    ("no_repeat_ngram_size", lambda v: v is not None and v > 0),
    ("bad_words_ids", lambda v: v is not None),
    ("sequence_bias", lambda v: v is not None),
    ("forced_bos_token_id", lambda v: v is not None),
    ("forced_eos_token_id", lambda v: v is not None),
    ("remove_invalid_values", lambda v: v is True),
    ("exponential_decay_length_penalty", lambda v: v is not None),
    ("suppress_tokens", lambda v: v is not None),
    ("begin_suppress_tokens", lambda v: v is not None),
    ("guidance_scale", lambda v: v is not None and v != 1),
    ("watermarking_config", lambda v: v is not None),
    # log_softmax at the end: same distribution, but a subtraction in fp32 can merge near-ties of argmax
    ("renormalize_logits", lambda v: v is True),
    ("token_healing", lambda v: bool(v)),
    ("stop_strings", lambda v: v is not None),
    ("max_time", lambda v: v is not None),
    ("dola_layers", lambda v: v is not None),
    ("prompt_lookup_num_tokens", lambda v: v is not None),
    ("assistant_early_exit", lambda v: v is not None),
    ("use_mtp", lambda v: bool(v)),
    ("constraints", lambda v: v is not None),
    ("force_words_ids", lambda v: v is not None),
)
# warpers transformers applies only when sampling
_UNSUPPORTED_WHEN_SAMPLING: tuple[tuple[str, object], ...] = (
    ("top_h", lambda v: v is not None),
    ("typical_p", lambda v: v is not None and v < 1.0),
    ("epsilon_cutoff", lambda v: v is not None and 0.0 < v < 1.0),
    ("eta_cutoff", lambda v: v is not None and 0.0 < v < 1.0),
)


def unsupported_settings(config) -> list[str]:
    """Names of the settings of a transformers ``GenerationConfig`` that the fused step does not implement
    and that are active in ``config`` (empty: every setting is one the runner applies exactly).

    Supported: do_sample, temperature, top_k, top_p, min_p, repetition_penalty, min_new_tokens,
    min_length, max_new_tokens, max_length, eos_token_id (up to ``max_eos`` ids), pad_token_id. Settings
    that only shape generate()'s outputs (output_scores, return_dict_in_generate, ...) are the caller's.
    """
    checks = _UNSUPPORTED + (_UNSUPPORTED_WHEN_SAMPLING if getattr(config, "do_sample", None) else ())
    return [name for name, active in checks if active(getattr(config, name, None))]


def _int(value, what: str) -> int:
    if isinstance(value, bool):
        raise GenerationSettingError(f"{what} must be an integer, got the bool {value!r}", setting=what, value=value)
    try:
        return operator.index(value)
    except TypeError:
        raise GenerationSettingError(
            f"{what} must be an integer, got {type(value).__name__} {value!r}", setting=what, value=value
        ) from None


def _float(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise GenerationSettingError(f"{what} must be a number, got {type(value).__name__} {value!r}",
                                     setting=what, value=value)
    return float(value)


def _token_ids(value, what: str) -> tuple[int, ...]:
    """An int, a sequence of ints or an integer tensor as a tuple of ints (None -> ())."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    elif not isinstance(value, (list, tuple)):
        value = [value]
    return tuple(_int(v, what) for v in value)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _f32_reciprocal(x: float) -> float:
    """``1 / float32(x)`` rounded to float32, as CUDA's ``tensor / python_scalar`` computes its factor."""
    return float(np.float32(1.0) / np.float32(x))


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """One row's generation settings on the host (validated when constructed).

    Attributes:
        do_sample: sample (True) or take the argmax of the processed scores (False; the warpers
            temperature / top_k / top_p / min_p are then not applied, as in transformers).
        temperature: > 0 when sampling (transformers' TemperatureLogitsWarper).
        top_k: tokens kept by TopKLogitsWarper; 0 = off (values above the vocabulary keep everything).
        top_p: TopPLogitsWarper's mass in ``[0, 1]``; 1.0 = off.
        min_p: MinPLogitsWarper's ratio in ``[0, 1]``; 0.0 = off.
        repetition_penalty: > 0; 1.0 = off (RepetitionPenaltyLogitsProcessor, prompt included).
        min_new_tokens: EOS ids are suppressed while fewer tokens than this were generated.
        max_new_tokens: >= 1; the row finishes when it has generated this many tokens.
        eos_token_ids: ids (each >= 0) that finish the row when generated; () = none.
        pad_token_id: >= 0; what a finished row emits (transformers: ``pad_token_id``, else the first EOS
            id; 0 when neither exists, where transformers never pads and no output shows it).
        seed: the row's random seed (any int; reduced to 64 bits two's complement). Unused when greedy.

    Raises:
        GenerationSettingError: a value of the wrong type or out of range (the message has the value).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    max_new_tokens: int = _DEFAULT_MAX_NEW_TOKENS
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        def bad(name, value, why):
            raise GenerationSettingError(f"{name}={value!r}: {why}", setting=name, value=value)

        if not isinstance(self.do_sample, (bool, np.bool_)):
            bad("do_sample", self.do_sample, "must be a bool")
        put("do_sample", bool(self.do_sample))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            put(name, _float(getattr(self, name), name))
        for name in ("top_k", "min_new_tokens", "max_new_tokens", "pad_token_id", "seed"):
            put(name, _int(getattr(self, name), name))
        put("eos_token_ids", _token_ids(self.eos_token_ids, "eos_token_ids"))
        if self.do_sample and not self.temperature > 0:
            bad("temperature", self.temperature,
                "must be > 0 when sampling (transformers' TemperatureLogitsWarper; greedy is do_sample=False)")
        if math.isinf(self.temperature) and self.do_sample:
            bad("temperature", self.temperature, "must be finite")
        if self.top_k < 0:
            bad("top_k", self.top_k, "must be >= 0 (0 = off)")
        if not 0.0 <= self.top_p <= 1.0:
            bad("top_p", self.top_p, "must be in [0, 1] (1.0 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "must be in [0, 1] (0.0 = off)")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            bad("repetition_penalty", self.repetition_penalty, "must be a finite number > 0 (1.0 = off)")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", self.min_new_tokens, "must be >= 0")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", self.max_new_tokens, "must be >= 1")
        if any(e < 0 for e in self.eos_token_ids):
            bad("eos_token_ids", self.eos_token_ids, "ids must be >= 0")
        if self.pad_token_id < 0:
            bad("pad_token_id", self.pad_token_id,
                "must be >= 0: a finished row feeds it to the model's embedding at the next step")
        put("seed", ((self.seed + (1 << 63)) % (1 << 64)) - (1 << 63))

    @classmethod
    def from_generation_config(cls, config, prompt_len: int, *, seed: int | None = None) -> RowSettings:
        """The settings generate() would apply to one row of ``input_ids`` under ``config``.

        Args:
            config: a transformers ``GenerationConfig``, as the user gave it (fields left None take
                transformers' global defaults: ``top_k=50`` when sampling, 20 new tokens, ...) or as
                generate() prepared it (``max_length`` then counts the prompt).
            prompt_len: tokens of the row's ``input_ids`` as generate() sees it (its width: left padding
                and a passed conversation included), for ``max_length`` / ``min_length``.
            seed: the row's seed; drawn from torch's default CPU generator (:func:`draw_seeds`) when None
                and the row samples; ignored (0) when greedy, so greedy rows never consume the generator.

        Length rules (transformers' ``_prepare_generated_length``): ``max_new_tokens`` wins over
        ``max_length``; a ``max_length`` left None means 20 new tokens (generate() also caps that at
        ``max_position_embeddings``, which a config does not know: pass ``max_new_tokens`` or a prepared
        config). ``min_new_tokens`` wins over ``min_length``; ``min_length`` counts the prompt. With no EOS
        id, ``min_*`` has nothing to suppress.

        Raises:
            UnsupportedGenerationSetting: the first setting of :func:`unsupported_settings`.
            GenerationSettingError: a value out of range, or lengths that leave no token to generate.
        """
        prompt_len = _int(prompt_len, "prompt_len")
        if prompt_len < 0:
            raise GenerationSettingError(f"prompt_len={prompt_len} must be >= 0", setting="prompt_len",
                                         value=prompt_len)
        active = unsupported_settings(config)
        if active:
            name = active[0]
            raise UnsupportedGenerationSetting(
                f"the fused decode step does not implement {name}={getattr(config, name)!r}"
                + (f" (also active: {', '.join(active[1:])})" if len(active) > 1 else ""),
                setting=name, value=getattr(config, name))

        def get(name):
            value = getattr(config, name, None)
            return _DEFAULTS[name] if value is None else value

        do_sample = bool(get("do_sample"))
        if config.max_new_tokens is not None:
            max_new = _int(config.max_new_tokens, "max_new_tokens")
        elif config.max_length is None:
            max_new = _DEFAULT_MAX_NEW_TOKENS
        else:
            max_new = _int(config.max_length, "max_length") - prompt_len
            if max_new < 1:
                raise GenerationSettingError(
                    f"max_length={config.max_length} leaves no token to generate after a prompt of "
                    f"{prompt_len} tokens (set max_new_tokens)", setting="max_length", value=config.max_length)
        if config.min_new_tokens is not None:
            min_new = _int(config.min_new_tokens, "min_new_tokens")
        else:
            min_new = max(0, _int(get("min_length"), "min_length") - prompt_len)
        eos = _token_ids(config.eos_token_id, "eos_token_id")
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        if not do_sample:  # transformers applies no warper when greedy: keep the row's warpers neutral
            return cls(do_sample=False, repetition_penalty=get("repetition_penalty"), min_new_tokens=min_new,
                       max_new_tokens=max_new, eos_token_ids=eos, pad_token_id=pad, seed=0)
        return cls(
            do_sample=True,
            temperature=get("temperature"),
            top_k=get("top_k"),
            top_p=get("top_p"),
            min_p=0.0 if config.min_p is None else config.min_p,
            repetition_penalty=get("repetition_penalty"),
            min_new_tokens=min_new,
            max_new_tokens=max_new,
            eos_token_ids=eos,
            pad_token_id=pad,
            seed=draw_seeds(1)[0] if seed is None else seed,
        )


class Rows(NamedTuple):
    """The first ``n`` rows of a :class:`RowState` (views: writes go to the state). All ``[n]`` unless said.

    Read by the step: ``temperature``, ``inv_temperature``, ``top_k``, ``top_p_cut``, ``min_p``,
    ``penalty``, ``inv_penalty`` (float32 / int32), ``do_sample`` (bool), ``min_new``, ``max_new``
    (int32), ``eos`` (int64 ``[n, E]``, -1 = none), ``pad`` (int64), ``seed`` (int64).
    Updated in place by :func:`~unimem_compile.runner.sampling.append_tokens`: ``count`` (int32),
    ``presence`` (bool ``[n, V]``), ``finished`` (bool), ``out`` (int64 ``[n, max_new_tokens]``),
    ``last_token`` (int64).
    """

    temperature: torch.Tensor
    inv_temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_cut: torch.Tensor
    min_p: torch.Tensor
    penalty: torch.Tensor
    inv_penalty: torch.Tensor
    do_sample: torch.Tensor
    min_new: torch.Tensor
    max_new: torch.Tensor
    eos: torch.Tensor
    pad: torch.Tensor
    seed: torch.Tensor
    count: torch.Tensor
    presence: torch.Tensor
    finished: torch.Tensor
    out: torch.Tensor
    last_token: torch.Tensor


# Row values of a cleared row, per Rows field (presence, out and eos are filled separately).
_CLEARED = {
    "temperature": 1.0, "inv_temperature": 1.0, "top_k": 0, "top_p_cut": 0.0, "min_p": 0.0, "penalty": 1.0,
    "inv_penalty": 1.0, "do_sample": False, "min_new": 0, "max_new": 1, "pad": 0, "seed": 0, "count": 0,
    "finished": True, "last_token": 0,
}
_DTYPES = {
    "temperature": torch.float32, "inv_temperature": torch.float32, "top_k": torch.int32,
    "top_p_cut": torch.float32, "min_p": torch.float32, "penalty": torch.float32, "inv_penalty": torch.float32,
    "do_sample": torch.bool, "min_new": torch.int32, "max_new": torch.int32, "pad": torch.int64,
    "seed": torch.int64, "count": torch.int32, "finished": torch.bool, "last_token": torch.int64,
}


def _device_values(settings: RowSettings, vocab_size: int) -> dict[str, object]:
    """The per-row scalars one row's settings put into the state (everything but eos / presence / out).
    A greedy row gets neutral warpers (transformers applies none when greedy)."""
    s = settings
    if not s.do_sample:
        s = dataclasses.replace(s, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return {
        "temperature": _f32(s.temperature),
        # CUDA computes transformers' `scores / python_float` as scores * float32(1 / float32(x)) (ATen's
        # div_true_kernel_cuda); the step multiplies by this factor on CUDA to round identically
        "inv_temperature": _f32_reciprocal(s.temperature),
        "top_k": min(s.top_k, vocab_size),  # TopKLogitsWarper keeps min(top_k, V)
        # TopPLogitsWarper compares float32 cumulative sums with the Python float (1 - top_p), which torch
        # casts to float32: the cut is computed in float64 first (float32(1) - float32(top_p) can differ)
        "top_p_cut": _f32(1.0 - s.top_p),
        "min_p": _f32(s.min_p),
        "penalty": _f32(s.repetition_penalty),
        "inv_penalty": _f32_reciprocal(s.repetition_penalty),
        "do_sample": s.do_sample,
        # a row finishes at max_new tokens, so suppressing EOS longer changes nothing (and fits int32)
        "min_new": min(s.min_new_tokens, s.max_new_tokens),
        "max_new": s.max_new_tokens,
        "pad": s.pad_token_id,
        "seed": s.seed,
        "count": 0,
        "finished": False,
        "last_token": s.pad_token_id,
    }


class RowState:
    """Generation settings and bookkeeping of ``max_rows`` rows, as device tensors at fixed addresses.

    Args:
        max_rows: rows (the largest batch bucket).
        vocab_size: ``V``, the width of the logits the step gets (the lm_head's output features).
        max_new_tokens: width of the output buffer ``out``: the most tokens one row may generate.
        device: where every tensor lives.
        max_eos: ``E``, EOS ids a row may hold (default :data:`DEFAULT_MAX_EOS` = 8).

    Raises:
        TypeError: a size that is not an integer.
        GeometryError: a size below 1.

    Tensors (attributes, each ``[max_rows, ...]``; a step reads :meth:`view`):
        temperature, inv_temperature (float32), top_k (int32, 0 = off), top_p_cut (float32, ``1 - top_p``
        rounded as transformers compares it; 0 = off), min_p (float32, 0 = off), penalty, inv_penalty
        (float32, the repetition penalty and its float32 reciprocal), do_sample (bool), min_new, max_new
        (int32, tokens), eos (int64 ``[max_rows, E]``, -1 = none), pad (int64), seed (int64), count (int32:
        tokens the row generated), presence (bool ``[max_rows, V]``: the tokens the repetition penalty
        applies to, prompt included), finished (bool), out (int64 ``[max_rows, max_new_tokens]``: generated
        tokens; positions at and after ``count`` hold the pad token), last_token (int64: the token appended
        last, the next step's input).

    Memory: ``max_rows * (V + 8 * max_new_tokens + 8 * E + 66)`` bytes (presence dominates: 64 rows of a
    163,840-token vocabulary are 10 MiB).

    Host API: :meth:`set_rows` / :meth:`set_row` / :meth:`set_row_from_config` (a request joins), :meth:`clear_row` /
    :meth:`clear_rows` (requests leave),
    :meth:`move_row`, :meth:`settings`, :meth:`any_sampling`, :meth:`generated`. Their device writes are
    enqueued on the current stream without synchronising (pinned staging for the few vectors), so they take
    effect between the steps queued before and after them on that stream: call them from the thread that
    replays the steps, on its stream. Every method validates all its arguments before writing anything.

    Every row starts cleared.
    """

    def __init__(self, max_rows: int, vocab_size: int, max_new_tokens: int, device, *,
                 max_eos: int = DEFAULT_MAX_EOS):
        for name, value in (("max_rows", max_rows), ("vocab_size", vocab_size),
                            ("max_new_tokens", max_new_tokens), ("max_eos", max_eos)):
            if as_int(value, name) < 1:
                raise GeometryError(f"RowState: {name}={value} must be >= 1")
        self.max_rows = int(max_rows)
        self.vocab_size = int(vocab_size)
        self.max_new_tokens = int(max_new_tokens)
        self.max_eos = int(max_eos)
        self.device = torch.device(device)
        d = self.device
        for name, dtype in _DTYPES.items():
            setattr(self, name, torch.empty(self.max_rows, dtype=dtype, device=d))
        self.device = self.count.device  # with its index ("cuda" -> "cuda:0"), to compare with tensors'
        self.eos = torch.empty(self.max_rows, self.max_eos, dtype=torch.int64, device=d)
        self.presence = torch.empty(self.max_rows, self.vocab_size, dtype=torch.bool, device=d)
        self.out = torch.empty(self.max_rows, self.max_new_tokens, dtype=torch.int64, device=d)
        self._settings: list[RowSettings | None] = [None] * self.max_rows
        self._clear(slice(0, self.max_rows))

    # ----------------------------------------------------------------------------------------- views
    def view(self, n: int) -> Rows:
        """Rows ``[0, n)`` as :class:`Rows` (views: the step's in-place writes land in this state).

        Raises:
            TypeError: ``n`` is not an integer.
            IndexError: ``n`` outside ``[1, max_rows]``.
        """
        n = as_int(n, "n")
        if not 1 <= n <= self.max_rows:
            raise IndexError(f"a step over {n} rows does not fit a RowState of {self.max_rows} rows")
        return Rows(**{name: getattr(self, name)[:n] for name in Rows._fields})

    def settings(self, row: int) -> RowSettings | None:
        """The host copy of row ``row``'s settings (None: cleared). Reads nothing from the device."""
        return self._settings[self._row(row)]

    def any_sampling(self, n: int) -> bool:
        """Whether a row in ``[0, n)`` samples (from the host copy): False means a step with
        ``sampling=False`` (no sort, no random numbers) decodes those rows exactly."""
        return any(s is not None and s.do_sample for s in self._settings[:n])

    def generated(self, row: int) -> list[int]:
        """Row ``row``'s generated tokens (``out[row, :count[row]]``). Synchronises: it reads the device."""
        row = self._row(row)
        n = int(self.count[row])
        return self.out[row, :n].tolist()

    # ------------------------------------------------------------------------------------ host writes
    def set_row(self, row: int, settings: RowSettings, prompt_ids, attention_mask=None) -> None:
        """Put one request into row ``row`` (see :meth:`set_rows`; ``prompt_ids`` / ``attention_mask``
        are 1-D)."""
        ids = self._ids_2d(prompt_ids, "prompt_ids")
        mask = None if attention_mask is None else self._ids_2d(attention_mask, "attention_mask")
        self.set_rows(row, [settings], ids, mask)

    def set_row_from_config(self, row: int, config, prompt_ids, attention_mask=None, *,
                            seed: int | None = None) -> RowSettings:
        """:meth:`set_row` with the settings generate() would derive from a transformers
        ``GenerationConfig`` for this prompt (:meth:`RowSettings.from_generation_config`, with
        ``prompt_len = len(prompt_ids)``); returns them.

        Raises:
            UnsupportedGenerationSetting, GenerationSettingError, IndexError: as the two calls it makes.
        """
        ids = self._ids_2d(prompt_ids, "prompt_ids")
        settings = RowSettings.from_generation_config(config, len(ids[0]), seed=seed)
        mask = None if attention_mask is None else self._ids_2d(attention_mask, "attention_mask")
        self.set_rows(row, [settings], ids, mask)
        return settings

    def set_rows(self, start: int, settings: Sequence[RowSettings], input_ids, attention_mask=None) -> None:
        """Put ``b = len(settings)`` requests into rows ``[start, start + b)``: their settings, a zero
        count, ``finished`` False, an output row of pad tokens, and the repetition-penalty presence of
        their prompts (requests already in those rows are replaced).

        Args:
            start: the first row.
            settings: one :class:`RowSettings` per row.
            input_ids: integer ``[b, L]`` (tensor on any device, or nested lists): the rows' token ids as
                generate() sees them (left padding and a passed conversation included). Ids must be >= 0;
                ids >= ``vocab_size`` are ignored, as transformers' penalty clamps and drops them.
            attention_mask: ``[b, L]`` or None. As transformers' ``_get_logits_processor``, a row's tokens
                before its first nonzero mask position (its left padding) are not penalised; None
                penalises every token.

        The presence rows are computed on the device (no read back); device tensors are used in place.

        Raises:
            IndexError: rows outside ``[0, max_rows)``.
            GenerationSettingError: a setting this state cannot hold (``max_new_tokens`` above the output
                buffer, more EOS ids than ``max_eos``), or ``input_ids`` / ``attention_mask`` of the wrong
                shape or with negative ids (checked when they are host data).
            TypeError: a settings entry that is not a RowSettings.
        """
        start = as_int(start, "start")
        b = len(settings)
        if b == 0:
            return
        if not (0 <= start and start + b <= self.max_rows):
            raise IndexError(f"rows [{start}, {start + b}) are outside the {self.max_rows} rows of this RowState")
        for s in settings:
            if not isinstance(s, RowSettings):
                raise TypeError(f"settings must be RowSettings, got {type(s).__name__}")
            if s.max_new_tokens > self.max_new_tokens:
                raise GenerationSettingError(
                    f"max_new_tokens={s.max_new_tokens} exceeds the output buffer of this RowState "
                    f"({self.max_new_tokens} tokens per row)", setting="max_new_tokens", value=s.max_new_tokens)
            if len(s.eos_token_ids) > self.max_eos:
                raise GenerationSettingError(
                    f"eos_token_id has {len(s.eos_token_ids)} ids {list(s.eos_token_ids)}; a row holds at most "
                    f"{self.max_eos} (RowState(max_eos=...))", setting="eos_token_id", value=s.eos_token_ids)
        ids = self._tokens_on_device(input_ids, "input_ids", b, None)
        mask = None if attention_mask is None else self._tokens_on_device(
            attention_mask, "attention_mask", b, ids.shape[1])

        rows = slice(start, start + b)
        values = [_device_values(s, self.vocab_size) for s in settings]
        for name, dtype in _DTYPES.items():
            self._upload(getattr(self, name)[rows], [v[name] for v in values], dtype)
        eos = [list(s.eos_token_ids) + [-1] * (self.max_eos - len(s.eos_token_ids)) for s in settings]
        self._upload(self.eos[rows], eos, torch.int64)
        pads = self.pad[rows]
        self.out[rows].copy_(pads[:, None].expand(b, self.max_new_tokens))
        self.presence[rows].copy_(self._presence(ids, mask))
        for i, s in enumerate(settings):
            self._settings[start + i] = s

    def clear_row(self, row: int) -> None:
        """Take row ``row``'s request out: the row becomes inert (finished, neutral settings, nothing
        present, an output row of zeros). Clearing a cleared row is a no-op.

        Raises:
            IndexError: ``row`` outside ``[0, max_rows)``.
        """
        row = self._row(row)
        self._clear(slice(row, row + 1))

    def clear_rows(self, start: int, stop: int) -> None:
        """:meth:`clear_row` for every row in ``[start, stop)``, in a few fills (an empty range is a no-op).

        Raises:
            IndexError: ``0 <= start <= stop <= max_rows`` does not hold.
        """
        start, stop = as_int(start, "start"), as_int(stop, "stop")
        if not 0 <= start <= stop <= self.max_rows:
            raise IndexError(f"rows [{start}, {stop}) are outside the {self.max_rows} rows of this RowState")
        if start < stop:
            self._clear(slice(start, stop))

    def move_row(self, src: int, dst: int) -> None:
        """Move row ``src``'s request (settings, count, presence, output, flags) to row ``dst`` and clear
        ``src``; ``dst``'s previous request is overwritten. ``src == dst`` is a no-op.

        Raises:
            IndexError: a row outside ``[0, max_rows)``.
        """
        src, dst = self._row(src), self._row(dst)
        if src == dst:
            return
        for name in Rows._fields:
            t = getattr(self, name)
            t[dst].copy_(t[src])
        self._settings[dst] = self._settings[src]
        self._clear(slice(src, src + 1))

    # ---------------------------------------------------------------------------------------- helpers
    def _row(self, row) -> int:
        row = as_int(row, "row")
        if not 0 <= row < self.max_rows:
            raise IndexError(f"row {row} is outside the {self.max_rows} rows of this RowState")
        return row

    def _clear(self, rows: slice) -> None:
        for name, value in _CLEARED.items():
            getattr(self, name)[rows] = value
        self.eos[rows] = -1
        self.presence[rows] = False
        self.out[rows] = 0
        self._settings[rows] = [None] * (rows.stop - rows.start)

    def _upload(self, dst: torch.Tensor, values, dtype: torch.dtype) -> None:
        src = torch.tensor(values, dtype=dtype)
        if dst.device.type == "cuda":  # pinned source + non_blocking: an async copy in stream order
            dst.copy_(src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)

    @staticmethod
    def _ids_2d(values, what: str):
        if isinstance(values, torch.Tensor):
            if values.dim() != 1:
                raise GenerationSettingError(f"{what} must be 1-D for one row, got shape {tuple(values.shape)}",
                                             setting=what, value=tuple(values.shape))
            return values[None]
        return [list(values)]

    def _tokens_on_device(self, values, what: str, rows: int, width: int | None) -> torch.Tensor:
        """``values`` as an int64 ``[rows, width]`` tensor on this state's device (host data checked)."""
        if isinstance(values, torch.Tensor):
            t = values
            if t.is_floating_point() or t.is_complex():
                raise GenerationSettingError(f"{what} must hold integers, got {t.dtype}", setting=what,
                                             value=t.dtype)
        else:
            try:
                t = torch.tensor(values, dtype=torch.int64)
            except (TypeError, ValueError) as e:
                raise GenerationSettingError(f"{what} must be a [rows, tokens] array of ints: {e}",
                                             setting=what, value=None) from None
        if t.dim() != 2 or t.shape[0] != rows or (width is not None and t.shape[1] != width):
            want = f"[{rows}, {width if width is not None else 'L'}]"
            raise GenerationSettingError(f"{what} has shape {list(t.shape)}, expected {want}", setting=what,
                                         value=list(t.shape))
        if t.device.type == "cpu" and t.numel() and bool((t < 0).any()):
            raise GenerationSettingError(f"{what} holds negative values (smallest {int(t.min())})",
                                         setting=what, value=int(t.min()))
        if t.device.type == "cpu" and self.device.type == "cuda":  # async, in stream order
            t = t.pin_memory().to(self.device, non_blocking=True)
        elif t.device != self.device:
            t = t.to(self.device)
        return t.to(torch.int64)

    def _presence(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """bool ``[b, V]``: the tokens RepetitionPenaltyLogitsProcessor penalises for these prompts."""
        b, length = ids.shape
        vocab = self.vocab_size
        keep = ids < vocab
        if mask is not None:  # transformers: prompt_ignore_length = (mask != 0).int().argmax(dim=1)
            first = (mask != 0).int().argmax(dim=1)
            keep &= torch.arange(length, device=ids.device)[None, :] >= first[:, None]
        seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=ids.device)  # column V: dropped ids
        seen.scatter_(1, torch.where(keep, ids, vocab), True)
        return seen[:, :vocab]
