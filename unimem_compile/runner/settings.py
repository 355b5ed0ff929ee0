"""A generate() call's per-row settings, read from the logits processors and stopping criteria transformers
built for it.

transformers' ``generate()`` turns its settings into a :class:`~transformers.LogitsProcessorList` and a
:class:`~transformers.StoppingCriteriaList` (``_get_logits_processor``, ``_get_stopping_criteria``), merges
the caller's own processors and criteria in, and hands both to its decoding method, which is where the
decode runner takes over (``generate(custom_generate=...)``). :func:`settings_from_generate` reads the
:class:`~.rows.RowSettings` the fused step needs from those objects (their types and their settings), so
what the runner applies is what transformers would have applied; anything it does not fuse (a processor of
another type, a user's processor of a known type in another place of the list, another stopping criterion)
raises :class:`~.rows.UnsupportedGenerationSetting` naming it, and the call runs transformers' own loop.

The processors are those of transformers 5.17 to 5.24, for ``num_beams=1``, in ``_get_logits_processor``'s
order: ``RepetitionPenaltyLogitsProcessor``, ``MinLengthLogitsProcessor`` /
``MinNewTokensLengthLogitsProcessor``, then when sampling ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``; the criteria ``MaxLengthCriteria`` and ``EosTokenCriteria``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .rows import GenerationSettingError, RowSettings, UnsupportedGenerationSetting, unsupported_settings

__all__ = ["PreparedSettings", "settings_from_generate"]

# type name -> its place in _get_logits_processor's order (each may appear once, in this order)
_PROCESSOR_ORDER = {
    "RepetitionPenaltyLogitsProcessor": 0,
    "MinLengthLogitsProcessor": 1,
    "MinNewTokensLengthLogitsProcessor": 2,
    "TemperatureLogitsWarper": 3,
    "TopKLogitsWarper": 4,
    "TopPLogitsWarper": 5,
    "MinPLogitsWarper": 6,
}
_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")


@dataclasses.dataclass(frozen=True)
class PreparedSettings:
    """What :func:`settings_from_generate` read.

    Attributes:
        settings: the rows' settings (``seed`` 0: the caller draws one per row when sampling).
        penalty_ignore: how many leading tokens of each row the repetition penalty skips: None (it
            penalises every token of ``input_ids``: transformers 5.17, or no padding mask), an int (every
            row), or an int64 ``[rows]`` tensor (transformers 5.24: each row's left pads).
    """

    settings: RowSettings
    penalty_ignore: int | torch.Tensor | None


def _refuse(setting: str, value, why: str):
    raise UnsupportedGenerationSetting(f"{why} ({setting}={value!r})", setting=setting, value=value)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _float_attr(processor, name: str) -> float:
    value = getattr(processor, name)
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def settings_from_generate(processors, criteria, config, prompt_len: int) -> PreparedSettings:
    """The per-row settings of a generate() call, from what transformers built for its decoding method.

    Args:
        processors: the ``LogitsProcessorList`` generate() passes its decoding method.
        criteria: the ``StoppingCriteriaList`` it passes.
        config: the prepared ``GenerationConfig`` (``do_sample``, ``_pad_token_tensor``).
        prompt_len: width of the decoding method's ``input_ids`` (left pads and cached tokens included): the
            lengths in ``MaxLengthCriteria`` / ``MinLengthLogitsProcessor`` count it.

    Returns:
        the :class:`PreparedSettings`.

    Raises:
        UnsupportedGenerationSetting: a setting of :func:`~.rows.unsupported_settings`, a processor or a
            criterion the fused step does not implement, a known one out of transformers' order or twice, a
            warper on a greedy call, a filter value other than ``-inf``, ``min_tokens_to_keep`` above 1, EOS
            ids that differ between the EOS criterion and the min-length processors, no
            ``MaxLengthCriteria``, or settings :class:`~.rows.RowSettings` refuses.
    """
    active = unsupported_settings(config)
    if active:
        _refuse(active[0], getattr(config, active[0], None), "the decode runner does not fuse this setting")
    do_sample = bool(getattr(config, "do_sample", False))
    fields: dict = {}
    penalty_ignore = None
    min_thresholds: list[int] = []
    suppress_eos: set[int] | None = None
    last = -1
    for p in processors:
        name = type(p).__name__
        place = _PROCESSOR_ORDER.get(name)
        if place is None or type(p).__module__.split(".")[0] != "transformers":
            _refuse("logits_processor", name, "a logits processor the decode runner does not fuse")
        if place <= last:
            _refuse("logits_processor", name, "a logits processor out of transformers' order, or twice")
        last = place
        if name in _WARPERS:
            if not do_sample:
                _refuse("logits_processor", name, "a warper on a greedy call (transformers builds none)")
            if getattr(p, "filter_value", -math.inf) != -math.inf:
                _refuse("filter_value", p.filter_value, f"{name} with a filter value other than -inf")
            if name != "TopKLogitsWarper" and getattr(p, "min_tokens_to_keep", 1) != 1:
                _refuse("min_tokens_to_keep", p.min_tokens_to_keep, f"{name} keeping more than one token")
        if name == "RepetitionPenaltyLogitsProcessor":
            for extra in ("logits_indices", "cu_seq_lens_q"):  # transformers' continuous-batching fields
                if getattr(p, extra, None) is not None:
                    _refuse(extra, "set", "a packed-batch repetition penalty")
            fields["repetition_penalty"] = _float_attr(p, "penalty")
            penalty_ignore = getattr(p, "prompt_ignore_length", None)
        elif name in ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"):
            ids = set(_ids(p.eos_token_id))
            if suppress_eos is not None and ids != suppress_eos:
                _refuse("eos_token_id", sorted(ids), "min-length processors suppressing different EOS ids")
            suppress_eos = ids
            # both suppress EOS while the sequence (prompt included) is shorter than a threshold
            min_thresholds.append(int(p.min_length) if name == "MinLengthLogitsProcessor"
                                  else int(p.prompt_length_to_skip) + int(p.min_new_tokens))
        elif name == "TemperatureLogitsWarper":
            fields["temperature"] = _float_attr(p, "temperature")
        elif name == "TopKLogitsWarper":
            fields["top_k"] = int(p.top_k)
        elif name == "TopPLogitsWarper":
            fields["top_p"] = _float_attr(p, "top_p")
        else:
            fields["min_p"] = _float_attr(p, "min_p")

    max_length = None
    eos: tuple[int, ...] = ()
    for c in criteria:
        name = type(c).__name__
        if type(c).__module__.split(".")[0] != "transformers" or name not in ("MaxLengthCriteria", "EosTokenCriteria"):
            _refuse("stopping_criteria", name, "a stopping criterion the decode runner does not fuse")
        if name == "MaxLengthCriteria":
            max_length = int(c.max_length) if max_length is None else min(max_length, int(c.max_length))
        else:
            if eos:
                _refuse("stopping_criteria", name, "two EOS criteria")
            eos = tuple(dict.fromkeys(_ids(c.eos_token_id)))
    if max_length is None:
        _refuse("stopping_criteria", "no MaxLengthCriteria", "a call without a length limit")
    if suppress_eos is not None and suppress_eos != set(eos):
        _refuse("eos_token_id", sorted(suppress_eos), "min-length processors and the EOS criterion name different "
                "EOS ids")
    pad = getattr(config, "_pad_token_tensor", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    pad_ids = _ids(pad)
    try:
        settings = RowSettings(
            do_sample=do_sample,
            min_new_tokens=max([0, *(t - prompt_len for t in min_thresholds)]),
            max_new_tokens=max_length - prompt_len,
            eos_token_ids=eos,
            # transformers pads finished rows only when an EOS criterion exists; without one no row finishes
            # early and the pad id is never emitted
            pad_token_id=pad_ids[0] if pad_ids and eos else 0,
            **fields,
        )
    except UnsupportedGenerationSetting:
        raise
    except GenerationSettingError as e:
        raise UnsupportedGenerationSetting(f"the decode runner cannot apply it: {e}", setting=e.setting,
                                           value=e.value) from None
    return PreparedSettings(settings=settings, penalty_ignore=penalty_ignore)
