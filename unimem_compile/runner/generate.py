"""The decode runner behind ``generate()``: the decoding method handed to transformers' hook for a custom
decoding loop (``generate(custom_generate=<callable>)``).

transformers' ``generate()`` prepares the call as usual (inputs, attention mask, ``num_return_sequences``
expansion, the cache, the logits processors and stopping criteria), then calls the callable where it would
call its own ``_sample``. :class:`RunnerDecoding` decides from what it receives (the processors' and
criteria's types and settings, the generation config, the model keywords): when every setting is one the
runner fuses, it runs transformers' own prefill (``_prefill``) and then the runner's decode steps
(:class:`~.decode.DecodeRunner`); otherwise it calls transformers' ``_sample`` unchanged and says once, at
INFO level on this module's logger, which setting caused it.

Outputs are transformers': the sequences (prompt, then each row's tokens, pad after it finished, as wide as
the longest row), or with ``return_dict_in_generate`` a ``GenerateDecoderOnlyOutput`` with ``sequences`` and
the cache. A streamer gets the prompt from generate() and then every step's tokens, K steps at a time.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .rng import draw_seeds
from .rows import UnsupportedGenerationSetting
from .settings import settings_from_generate

__all__ = ["RunnerDecoding", "fallback"]

logger = logging.getLogger(__name__)

#: model keywords generate() hands its decoding method for the models the runner serves; another one (say
#: ``token_type_ids``) feeds the forward something the runner's step does not pass, so the call falls back
_MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache",
                           "past_key_values", "output_attentions", "output_hidden_states"})

_said: set[str] = set()


def fallback(reason: str) -> None:
    """Say (once per process and reason, INFO) that a generate() call runs transformers' own decode loop."""
    if reason not in _said:
        _said.add(reason)
        logger.info("generate() runs transformers' own decode loop instead of the decode runner: %s", reason)


class RunnerDecoding:
    """One generate() call's decoding method (transformers calls it as ``_sample`` would be called).

    Args:
        runner: the model's :class:`~.decode.DecodeRunner`.
        passed: whether the call's cache is one the caller passed (its finished rows keep storing pad tokens,
            as stock generate() stores them, so a continuation sees the cache stock would have).
        streamer: the call's streamer (transformers does not hand it to a custom decoding method), or None.
        synced_gpus: the call's ``synced_gpus`` (anything but False/None runs transformers' loop).
    """

    def __init__(self, runner, *, passed: bool, streamer=None, synced_gpus=None):
        self.runner = runner
        self.passed = passed
        self.streamer = streamer
        self.synced_gpus = synced_gpus

    def refusal(self, processors, criteria, config, model_kwargs, prompt_len: int):
        """``(reason, prepared settings)``: why the runner cannot decode this call (None when it can) and,
        when it can, the :class:`~.settings.PreparedSettings`."""
        if self.synced_gpus:
            return f"synced_gpus={self.synced_gpus!r}", None
        if getattr(config, "return_dict_in_generate", False):
            for name in ("output_scores", "output_logits"):
                if getattr(config, name, False):
                    return f"{name}=True (the runner keeps no per-step scores)", None
        extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS and v is not None)
        if extra:
            return f"the model keyword {extra[0]} (the runner's step does not pass it to the forward)", None
        try:
            prepared = settings_from_generate(processors, criteria, config, prompt_len)
        except UnsupportedGenerationSetting as e:
            return f"{e.setting}: {e}", None
        eos = len(prepared.settings.eos_token_ids)
        if eos > self.runner.state.max_eos:
            return f"eos_token_id with {eos} ids (a runner row holds {self.runner.state.max_eos})", None
        return None, prepared

    def __call__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        reason, prepared = self.refusal(logits_processor, stopping_criteria, generation_config, model_kwargs,
                                        input_ids.shape[1])
        if reason is not None:
            fallback(reason)
            return model._sample(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                                 generation_config=generation_config, synced_gpus=bool(self.synced_gpus),
                                 streamer=self.streamer, **model_kwargs)
        rows = input_ids.shape[0]
        seeds = draw_seeds(rows) if prepared.settings.do_sample else [0] * rows  # at the call's start
        settings = [dataclasses.replace(prepared.settings, seed=s) for s in seeds]
        outputs = model._prefill(input_ids, generation_config, model_kwargs)
        timing = self.runner.timing
        if timing is not None:
            timing.begin()
        logits = outputs.logits[:, -1]
        cache = next(model_kwargs[k] for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None)
        del outputs
        tokens = self.runner.run(cache, input_ids, settings, logits, penalty_ignore=prepared.penalty_ignore,
                                 pads_after_finish=self.passed, streamer=self.streamer, timing=timing)
        sequences = torch.cat([input_ids, tokens], dim=-1)
        if self.streamer is not None:
            self.streamer.end()
        if not getattr(generation_config, "return_dict_in_generate", False):
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        names = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
        key = "cache" if "cache" in names else "past_key_values"  # transformers 5.24 / 5.17
        return GenerateDecoderOnlyOutput(sequences=sequences, **{key: cache})
