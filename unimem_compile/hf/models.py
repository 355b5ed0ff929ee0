"""Built-in model configs with random weights (no downloads): the demo's models, the tests' and the
benchmarks'.

* ``kimi-linear-tiny``: 4 layers (KDA, MLA, KDA, MLA), hidden 256, 3.6M parameters; runs on a CPU in seconds.
* ``deepseek-v3-tiny``: 3 MLA layers with a q LoRA, RoPE and a small MoE.
* ``kimi-linear-48b-4l``: the real Kimi-Linear-48B-A3B per-layer geometry (hidden 2304, 32 heads,
  kv_lora_rank 512 + qk_rope_head_dim 64, v 128, KDA 32 x 128, conv 4) with 4 layers (3 KDA + 1 MLA) and
  a small MoE (8 experts, 2 active, 1 shared), for GPU benchmarks.
* ``kimi-linear-48b-8l``: the same with 8 layers in the real 20:7 pattern shape (KDA, KDA, KDA, MLA) x 2.
"""

from __future__ import annotations

import torch

__all__ = ["MODEL_PRESETS", "model_config", "build_model"]


def _kimi_tiny():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=1, linear_num_heads=4, linear_head_dim=32,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
        mlp_layer_types=["dense", "sparse"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _kimi_real(layers: int):
    from transformers import KimiLinearConfig

    pattern = ["linear_attention"] * 3 + ["full_attention"]
    return KimiLinearConfig(
        vocab_size=32000, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_local_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, linear_num_heads=32,
        linear_head_dim=128, linear_conv_kernel_dim=4, layer_types=(pattern * layers)[:layers],
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _deepseek_tiny():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )


#: name -> config factory
MODEL_PRESETS = {
    "kimi-linear-tiny": _kimi_tiny,
    "deepseek-v3-tiny": _deepseek_tiny,
    "kimi-linear-48b-4l": lambda: _kimi_real(4),
    "kimi-linear-48b-8l": lambda: _kimi_real(8),
}


def model_config(name: str):
    """The transformers config of a preset; ValueError listing the presets otherwise."""
    try:
        return MODEL_PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)}") from None


def build_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int = 0, attn_implementation: str = "sdpa", dense_mlp: bool = False):
    """A preset model with random weights (seeded), in eval mode, on ``device`` in ``dtype``.

    ``dense_mlp``: every mixture-of-experts MLP becomes a dense one (same attention, KDA and cache
    geometry): a network without top-k routing, whose outputs respond smoothly to small changes of its
    inputs (the fp8 KV accuracy tests need that; a router picks another expert on a tiny change)."""
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    config._attn_implementation = attn_implementation
    if dense_mlp:
        if config.model_type == "kimi_linear":
            config.mlp_layer_types = ["dense"] * config.num_hidden_layers
        else:
            config.first_k_dense_replace = config.num_hidden_layers
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
