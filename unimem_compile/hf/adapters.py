"""Model-family adapters: what a Hugging Face model's layers need from the pool.

An adapter reads a model's config (layer kinds from ``config.layer_types``, never from ``head_dim`` or
``num_key_value_heads``), builds the pool's sub-pool specs, and knows how the family's modeling code
talks to its cache. Supported families: Kimi-Linear (MLA + KDA), DeepSeek-V3 and DeepSeek-V2 (MLA only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator

import torch

from .. import env
from ..errors import GeometryError, UnsupportedModel
from ..pool import KERNEL_KV_DTYPES, LinearStateSpec, MLASpec

__all__ = ["ModelAdapter", "SUPPORTED_FAMILIES", "adapter_for", "adapter_for_config"]

#: model_type -> model class names supported, for error messages
SUPPORTED_FAMILIES = {
    "kimi_linear": "KimiLinearForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class ModelAdapter:
    """How one model maps onto the pool.

    Attributes:
        family: the config's ``model_type``.
        num_layers: decoder layers of the model.
        mla_layers: model layer indices of the MLA layers; position in this tuple = pool KV layer.
        linear_layers: model layer indices of the linear-attention (KDA) layers; position = state layer.
        kv_spec: the MLA sub-pool spec (None without MLA layers).
        state_spec: the state sub-pool spec (None without linear layers).
        conv_shape: per linear layer ``[conv_dim, kernel]`` (empty without linear layers).
        recurrent_shape: per linear layer ``[H, K, V]``.
    """

    family: str
    num_layers: int
    mla_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    kv_spec: MLASpec | None
    state_spec: LinearStateSpec | None

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return self.state_spec.layers[0].conv.shape if self.state_spec else ()

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return self.state_spec.layers[0].recurrent.shape if self.state_spec else ()

    def kernel_patches(self) -> dict[str, Callable]:
        """Module-level functions of the family's modeling module to replace while the model runs."""
        if self.family != "kimi_linear":
            return {}
        from . import kda_kernels

        modeling = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
        patches = {"chunk_kimi_delta_attention": kda_kernels.chunk_kimi_delta_attention}
        # transformers binds these to flash-linear-attention / causal-conv1d when installed; those kernels
        # do not trace. Their torch paths (kept under the hub wrapper) trace into small graphs that the
        # state passes rewrite into in-place slot kernels.
        for name in ("recurrent_kimi_delta_attention", "causal_conv1d_update", "causal_conv1d_fn"):
            patches[name] = inspect.unwrap(getattr(modeling, name))
        if env.prefill_conv() == "shifted":  # (read per forward: a change recompiles, Dynamo guards on it)
            patches["causal_conv1d_fn"] = kda_kernels.causal_conv1d_shifted
        return patches

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Swap the family's kernel functions (see :meth:`kernel_patches`) for the duration of a forward."""
        patches = self.kernel_patches()
        if not patches:
            yield
            return
        modeling = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
        saved = {name: getattr(modeling, name) for name in patches}
        for name, fn in patches.items():
            setattr(modeling, name, fn)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(modeling, name, fn)


def _mla_spec(config, layer_num: int, kv_dtype: torch.dtype) -> MLASpec:
    return MLASpec(layer_num, int(config.kv_lora_rank), int(config.qk_rope_head_dim), kv_dtype)


def adapter_for(model: torch.nn.Module, kv_dtype: torch.dtype | None = None) -> ModelAdapter:
    """The adapter of ``model`` (a ``*ForCausalLM`` of a supported family).

    Args:
        model: the Hugging Face model.
        kv_dtype: dtype of the latent KV rows (None: the model's dtype); an fp8 one (e4m3fn, e4m3fnuz)
            makes the rows scaled fp8 rows whose rope is bf16 whatever the model's dtype.

    Raises:
        UnsupportedModel: the family is not supported (the message lists the supported ones), or its
            config lacks what the pool needs.
        GeometryError: ``kv_dtype`` (or the model's dtype) is not one of
            :data:`~unimem_compile.pool.specs.KERNEL_KV_DTYPES`, the dtypes its write and attention ops
            read and write (the pool itself also stores e5m2 rows, which no op reads).
    """
    config = getattr(model, "config", None)
    _check_family(config, type(model).__name__)
    return adapter_for_config(config, next(model.parameters()).dtype, kv_dtype)


def _check_family(config, what: str) -> None:
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        supported = ", ".join(f"{cls} ({mt})" for mt, cls in SUPPORTED_FAMILIES.items())
        raise UnsupportedModel(f"{what} (model_type={family!r}) is not supported; supported: {supported}")


def adapter_for_config(config, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> ModelAdapter:
    """The adapter of a model described by ``config`` (a transformers config of a supported family) whose
    parameters are ``dtype``: what :func:`adapter_for` returns for such a model, without building it
    (``unimem-compile pool-info --config`` sizes a checkpoint's arena from its ``config.json``).

    Raises:
        the errors of :func:`adapter_for`.
    """
    _check_family(config, type(config).__name__)
    family = config.model_type
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if kv_dtype not in KERNEL_KV_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in KERNEL_KV_DTYPES)
        raise GeometryError(f"kv_dtype {kv_dtype} is not supported for a model's cache (the write and attention "
                            f"ops read and write {names}); pass kv_dtype= one of those")
    n = int(config.num_hidden_layers)
    if family == "kimi_linear":
        layer_types = list(getattr(config, "layer_types", None) or [])
        if len(layer_types) < n:
            raise UnsupportedModel(f"KimiLinear config has {len(layer_types)} layer_types for {n} layers")
        mla = tuple(i for i in range(n) if layer_types[i] == "full_attention")
        linear = tuple(i for i in range(n) if layer_types[i] == "linear_attention")
        other = sorted(set(range(n)) - set(mla) - set(linear))
        if other:
            raise UnsupportedModel(f"KimiLinear layers {other} have layer types {[layer_types[i] for i in other]}")
        state = None
        if linear:
            state = LinearStateSpec.kda(
                len(linear),
                num_heads=int(config.linear_num_heads),
                head_dim=int(config.linear_head_dim),
                conv_kernel=int(config.linear_conv_kernel_dim),
                conv_dtype=dtype,
            )
        kv = _mla_spec(config, len(mla), kv_dtype) if mla else None
        return ModelAdapter(family, n, mla, linear, kv, state)
    # DeepSeek-V2 / V3: every layer is MLA
    return ModelAdapter(family, n, tuple(range(n)), (), _mla_spec(config, n, kv_dtype), None)
