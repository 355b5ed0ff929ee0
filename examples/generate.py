"""Give a Hugging Face Kimi-Linear model one unified memory pool and a compiled forward, then generate.

    python examples/generate.py                      # tiny random-weight model on the CPU
    python examples/generate.py --device cuda        # bf16 on a GPU: each decode step one CUDA-graph replay

With a real checkpoint, build the model with `AutoModelForCausalLM.from_pretrained(...)` instead.
"""

import argparse

import torch

import unimem_compile
from unimem_compile.hf.models import MODEL_PRESETS, build_model

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
parser.add_argument("--model", default="kimi-linear-tiny", choices=sorted(MODEL_PRESETS),
                    help="a built-in random-weight model (default kimi-linear-tiny)")
args = parser.parse_args()
on_gpu = args.device.startswith("cuda")

model = build_model(args.model, dtype=torch.bfloat16 if on_gpu else torch.float32, device=args.device)
# cudagraphs defaults to on for a CUDA model: the decode runner replays one captured graph per decode step
model = unimem_compile.compile(model, max_batch_size=4, max_seq_len=256)

# two left-padded prompts (token ids of a random-weight model: any ids in the vocabulary will do)
input_ids = torch.randint(3, model.config.vocab_size, (2, 40), device=args.device)
attention_mask = torch.ones_like(input_ids)
input_ids[1, :12], attention_mask[1, :12] = model.config.pad_token_id, 0

out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=32, do_sample=False)
print("generated", tuple(out.shape), "tokens; first row:", out[0, 40:].tolist())
print("pool:", model.unimem.stats())        # pages/slots in use are 0 again: generate() released them
print("rewrites:", model.unimem.rewrites)   # replacements the graph passes made
