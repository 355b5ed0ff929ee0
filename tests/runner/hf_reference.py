"""Stock transformers as the reference for the runner's sampling tests: a tiny random Llama, the logits
processors and config generate() prepares for a call (taken through ``generate(custom_generate=...)``), and a
decode loop that is ``GenerationMixin._sample`` with its processors, sampling and stopping replaced by the
runner's fused step."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from unimem_compile.runner import RowSettings, RowState, decode_step, draw_seeds

VOCAB = 96


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A one-layer random Llama (fp32, CPU, eval mode) with bos 1, eos 2 and no pad token."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def prepared(model, ids, mask, **generate_kwargs):
    """What generate() hands its decoding method for this call: ``{"processors", "config", "criteria"}``."""
    got = {}

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        got.update(processors=logits_processor, config=generation_config, criteria=stopping_criteria)
        return input_ids

    with torch.no_grad():
        model.generate(ids, attention_mask=mask, custom_generate=capture, **generate_kwargs)
    return got


def runner_generate(model, ids, mask, *, max_new_tokens_buffer: int = 64, **generate_kwargs):
    """generate() with the runner's step as the decoding method (eager, no graphs): ``_sample``'s prefill
    and model-kwargs bookkeeping, then ``decode_step`` for processing, sampling, appending and stopping.
    Seeds come from torch's default generator when the call starts. Returns the sequences, prompt
    included, as generate() does."""

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        b, length = input_ids.shape
        seeds = draw_seeds(b) if generation_config.do_sample else [0] * b
        state = RowState(b, model.config.vocab_size, max_new_tokens_buffer, input_ids.device)
        state.set_rows(0, [RowSettings.from_generation_config(generation_config, length, seed=s) for s in seeds],
                       input_ids, model_kwargs.get("attention_mask"))
        rows = state.view(b)
        outputs = model._prefill(input_ids, generation_config, model_kwargs)
        while True:
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
            tokens = decode_step(outputs.logits[:, -1], rows, sampling=state.any_sampling(b))
            input_ids = torch.cat([input_ids, tokens[:, None].clone()], dim=-1)
            if bool(rows.finished.all()):
                return input_ids
            inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            outputs = model(**inputs, return_dict=True)

    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, custom_generate=decode, **generate_kwargs)
