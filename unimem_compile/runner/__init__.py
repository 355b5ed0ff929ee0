"""The decode runner's device-side core (DESIGN.md section 8): per-row generation settings as device
tensors, fused logits processing + sampling + the append step, and the batch-size buckets its graphs are
captured for.

    state = RowState(max_rows=32, vocab_size=V, max_new_tokens=256, device="cuda")
    state.set_rows(0, [RowSettings.from_generation_config(cfg, prompt_len=L, seed=s) for s in draw_seeds(B)],
                   input_ids, attention_mask)
    n = bucket_for(B, 32)
    next_ids = decode_step(logits[:, -1], state.view(n))      # capturable: no host sync

Modules: :mod:`.rows` (RowSettings, RowState), :mod:`.sampling` (process_logits, sample, append_tokens,
decode_step), :mod:`.rng` (Philox counter-based noise), :mod:`.buckets`, :mod:`.settings` (RowSettings from
the processors and criteria transformers' generate() built), :mod:`.decode` (DecodeRunner: the decode steps
of a compiled model as replays of captured steps), :mod:`.generate` (the runner as generate()'s decoding
method).
"""

from .buckets import BUCKET_STEP, bucket_for, bucket_sizes
from .decode import DEFAULT_STEPS_AHEAD, DecodeRunner, DecodeTiming, StepGraphStats
from .rng import draw_seeds
from .rows import (
    DEFAULT_MAX_EOS,
    GenerationSettingError,
    Rows,
    RowSettings,
    RowState,
    UnsupportedGenerationSetting,
    unsupported_settings,
)
from .sampling import append_tokens, decode_step, process_logits, sample
from .settings import PreparedSettings, settings_from_generate

__all__ = [
    "BUCKET_STEP",
    "DEFAULT_MAX_EOS",
    "DEFAULT_STEPS_AHEAD",
    "DecodeRunner",
    "DecodeTiming",
    "PreparedSettings",
    "StepGraphStats",
    "GenerationSettingError",
    "Rows",
    "RowSettings",
    "RowState",
    "UnsupportedGenerationSetting",
    "append_tokens",
    "bucket_for",
    "bucket_sizes",
    "decode_step",
    "draw_seeds",
    "process_logits",
    "sample",
    "settings_from_generate",
    "unsupported_settings",
]
