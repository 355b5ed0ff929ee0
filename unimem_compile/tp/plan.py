"""The tensor-parallel plan: which parameter of a model is cut over the ranks, how, and where partial sums
are reduced. Pure functions of the model's module tree, its config and the world size: nothing here talks to
another process, so every rank computes the same plan, and the tests check it by slicing in one process.

The plan (docs/design.md section 9):

* MLA layers (Kimi-Linear's full-attention layers, every DeepSeek layer): the heads are cut, Megatron-style
  (Shoeybi et al. 2019; vLLM's MLA does the same): ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are
  column-parallel (each rank computes its heads' queries and expands the latent into its heads' keys and
  values), ``o_proj`` is row-parallel (each rank's heads give a partial sum of the output, all-reduced). The
  latent projection ``kv_a_proj_with_mqa``, its norm and the q LoRA (``q_a_proj``, ``q_a_layernorm``) have no
  head dimension: replicated, so every rank writes and reads the full 576-wide latent rows for its heads.
* KDA layers: every projection with a head dimension is column-parallel over the heads (``q_proj``,
  ``k_proj``, ``v_proj``, ``b_proj``, ``f_b_proj``, ``g_b_proj``, the depthwise ``conv1d`` over q|k|v, the
  per-channel ``dt_bias`` and the per-head ``A_log``); the low-rank ``f_a_proj`` / ``g_a_proj`` and the
  per-head-dim ``o_norm`` are replicated; ``o_proj`` is row-parallel. Each rank holds its heads' states.
* MLP and MoE blocks: transformers' own ``config.base_model_tp_plan`` for these families (``colwise``,
  ``rowwise``, ``packed_colwise`` for the experts' fused gate|up, ``moe_tp_experts``): every expert's
  intermediate dimension is cut, the router is replicated, and the block's output (routed experts + shared
  experts, or the dense MLP) is all-reduced ONCE at the block's output, where transformers' plan reduces the
  routed and the shared experts separately.
* ``lm_head``: column-parallel over the vocabulary, its logits all-gathered (transformers'
  ``colwise_gather_output``): every decode step reads the whole ``lm_head``, and the gather moves only
  ``B x vocab`` logits. Replicated instead when the vocabulary does not divide by the world size.
* ``embed_tokens`` and every norm: replicated (a lookup reads only the step's rows; see docs/design.md).

A row-parallel bias is kept on rank 0 and zeroed elsewhere, so the all-reduce adds it once.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from ..errors import GeometryError, UnsupportedModel

__all__ = ["Split", "BIAS_ON_RANK0", "TensorParallelPlan", "shard_tensor", "plan_model", "apply_plan"]

#: the action for a row-parallel layer's bias: kept on rank 0, zeros on the others (added once by the sum)
BIAS_ON_RANK0 = "bias_on_rank0"


@dataclasses.dataclass(frozen=True)
class Split:
    """How one tensor is cut over the ranks: dimension ``dim`` holds ``parts`` equal blocks laid end to end
    (1; 3 for a convolution over q|k|v; 2 for experts' packed gate|up), and each block is cut into
    ``world_size`` equal contiguous pieces; rank r keeps piece r of every block, in block order."""

    dim: int
    parts: int = 1


def shard_tensor(tensor: torch.Tensor, split: Split, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``tensor`` under ``split``: a new contiguous tensor (never a view, so the
    full tensor can be freed), of size ``tensor.shape[dim] // world_size`` along ``split.dim``.

    Raises:
        GeometryError: ``tensor.shape[dim]`` is not a multiple of ``parts * world_size``.
    """
    dim = split.dim % tensor.dim()
    size = tensor.shape[dim]
    if size % (split.parts * world_size):
        what = f"{split.parts} blocks of {size // split.parts}" if split.parts > 1 else f"{size}"
        raise GeometryError(f"a dimension of {what} does not divide over {world_size} ranks "
                            f"(tensor of shape {list(tensor.shape)}, dimension {dim})")
    block = size // split.parts
    piece = block // world_size
    pieces = [tensor.narrow(dim, b * block + rank * piece, piece) for b in range(split.parts)]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone(memory_format=torch.contiguous_format)


@dataclasses.dataclass
class TensorParallelPlan:
    """What :func:`apply_plan` does to a model on each rank.

    Attributes:
        world_size: ranks the model is cut over.
        params: qualified parameter name -> :class:`Split`, or :data:`BIAS_ON_RANK0`. Every parameter not
            named here is replicated (``replicated`` lists them).
        replicated: qualified names of the parameters every rank keeps whole.
        attributes: ``(module name, attribute, local value)``: module attributes transformers' forward
            reads (head counts, widths), set to the rank's share.
        config: config attribute -> local value (``num_attention_heads``, ``linear_num_heads``,
            intermediate sizes): what a reader of the config (the pool's adapter) sees after sharding.
        reduce_outputs: modules whose output is a partial sum, all-reduced over the ranks.
        gather_outputs: modules whose output is cut along its last dimension, all-gathered over the ranks.
        notes: choices made for this model that the defaults above do not say (a replicated ``lm_head``).
    """

    world_size: int
    params: dict[str, Split | str] = dataclasses.field(default_factory=dict)
    replicated: list[str] = dataclasses.field(default_factory=list)
    attributes: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    config: dict[str, int] = dataclasses.field(default_factory=dict)
    reduce_outputs: list[str] = dataclasses.field(default_factory=list)
    gather_outputs: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> dict:
        """A JSON-able overview: the world size, how many parameters are cut / replicated, the reduction and
        gather points, the config's local values and the notes."""
        return {"world_size": self.world_size, "sharded_params": len(self.params),
                "replicated_params": len(self.replicated), "all_reduce_outputs": list(self.reduce_outputs),
                "all_gather_outputs": list(self.gather_outputs), "local_config": dict(self.config),
                "notes": list(self.notes)}


# ------------------------------------------------------------------------------------------- attention
_MLA_COLUMN = ("q_proj", "q_b_proj", "kv_b_proj")
_MLA_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
_KDA_COLUMN = ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_b_proj", "g_b_proj")
_KDA_REPLICATED = ("forget_gate.f_a_proj", "g_a_proj", "o_norm")


def _is_mla(attn: nn.Module) -> bool:
    return hasattr(attn, "kv_b_proj") and hasattr(attn, "kv_a_proj_with_mqa")


def _is_kda(attn: nn.Module) -> bool:
    return hasattr(attn, "conv1d") and hasattr(attn, "forget_gate") and hasattr(attn, "b_proj")


def _local(what: str, count: int, world_size: int) -> int:
    """``count // world_size``; GeometryError saying ``what`` (e.g. "MLA layer 1 has 4 attention heads")
    when ``world_size`` does not divide ``count``."""
    if count % world_size:
        raise GeometryError(f"tensor parallel over {world_size} ranks: {what}, not a multiple of {world_size} "
                            f"(every rank must hold as many); use a world size that divides {count}")
    return count // world_size


def _linear_actions(plan: TensorParallelPlan, module: nn.Module, path: str, style: str) -> None:
    """A ``nn.Linear``'s weight and bias under ``style``: ``colwise`` (output features), ``rowwise`` (input
    features; bias on rank 0), ``packed_colwise`` (output features holding two packed blocks)."""
    if style == "colwise":
        plan.params[f"{path}.weight"] = Split(0)
        if module.bias is not None:
            plan.params[f"{path}.bias"] = Split(0)
    elif style == "packed_colwise":
        plan.params[f"{path}.weight"] = Split(0, 2)
        if module.bias is not None:
            plan.params[f"{path}.bias"] = Split(0, 2)
    elif style == "rowwise":
        plan.params[f"{path}.weight"] = Split(1)
        if module.bias is not None:
            plan.params[f"{path}.bias"] = BIAS_ON_RANK0
    else:
        raise UnsupportedModel(f"{path}: tensor-parallel style {style!r} is not one unimem_compile applies "
                               "(colwise, rowwise, packed_colwise)")


def _plan_mla(plan: TensorParallelPlan, attn: nn.Module, path: str, layer: int) -> None:
    world = plan.world_size
    heads = _local(f"MLA layer {layer} has {attn.num_heads} attention heads", int(attn.num_heads), world)
    for name in _MLA_COLUMN:
        if getattr(attn, name, None) is not None:
            _linear_actions(plan, getattr(attn, name), f"{path}.{name}", "colwise")
    _linear_actions(plan, attn.o_proj, f"{path}.o_proj", "rowwise")
    plan.attributes.append((path, "num_heads", heads))
    plan.reduce_outputs.append(f"{path}.o_proj")
    _check_known(attn, path, _MLA_COLUMN + ("o_proj",) + _MLA_REPLICATED)


def _plan_kda(plan: TensorParallelPlan, attn: nn.Module, path: str, layer: int) -> None:
    world = plan.world_size
    heads = _local(f"KDA layer {layer} has {attn.num_heads} heads", int(attn.num_heads), world)
    if attn.conv_dim != 3 * attn.qkv_dim:
        raise UnsupportedModel(f"{path}: conv1d has {attn.conv_dim} channels, not 3 x qkv_dim = {3 * attn.qkv_dim} "
                               "(q|k|v of equal width), which the KDA plan cuts in three")
    for name in _KDA_COLUMN:
        _linear_actions(plan, attn.get_submodule(name), f"{path}.{name}", "colwise")
    plan.params[f"{path}.conv1d.weight"] = Split(0, 3)  # [q | k | v channels, 1, kernel], each head-major
    if attn.conv1d.bias is not None:
        plan.params[f"{path}.conv1d.bias"] = Split(0, 3)
    plan.params[f"{path}.forget_gate.dt_bias"] = Split(0)  # [H * K] per channel, head-major
    plan.params[f"{path}.forget_gate.A_log"] = Split(2)  # [1, 1, H, 1] per head
    _linear_actions(plan, attn.o_proj, f"{path}.o_proj", "rowwise")
    qkv, conv = attn.qkv_dim // world, attn.conv_dim // world
    plan.attributes += [(path, "num_heads", heads), (path, "qkv_dim", qkv), (path, "conv_dim", conv),
                        (f"{path}.conv1d", "in_channels", conv), (f"{path}.conv1d", "out_channels", conv),
                        (f"{path}.conv1d", "groups", conv), (f"{path}.forget_gate", "num_heads", heads),
                        (f"{path}.forget_gate", "qkv_dim", qkv)]
    plan.reduce_outputs.append(f"{path}.o_proj")
    _check_known(attn, path, _KDA_COLUMN + _KDA_REPLICATED + ("o_proj", "conv1d", "forget_gate.dt_bias",
                                                              "forget_gate.A_log"))


def _check_known(module: nn.Module, path: str, known: tuple[str, ...]) -> None:
    """Refuse a module with a parameter the plan has no rule for (a newer transformers adding a projection
    with a head dimension would otherwise run replicated, and wrong)."""
    for name, _ in module.named_parameters():
        if not any(name == k or name.startswith(k + ".") for k in known):
            raise UnsupportedModel(f"{path}.{name}: the tensor-parallel plan has no rule for this parameter "
                                   f"(known: {', '.join(known)})")


# ------------------------------------------------------------------------------------------- MLP / MoE
def _tp_plan_rules(config) -> list[tuple[re.Pattern, str]]:
    """transformers' ``base_model_tp_plan`` entries for ``layers.*.mlp.*``, as (regex over module or
    parameter names relative to the base model, style)."""
    rules = []
    for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if not key.startswith("layers.*.mlp."):
            continue
        rules.append((re.compile(re.escape(key).replace(r"\*", r"\d+") + "$"), style))
    return rules


def _plan_mlp(plan: TensorParallelPlan, mlp: nn.Module, path: str, relative: str, rules) -> None:
    """``mlp`` (a dense MLP or an MoE block, at ``path``; ``relative`` is that name relative to the base
    model, as the plan's keys are written) under transformers' plan; its output is all-reduced once."""
    covered: set[str] = set()
    for name, module in mlp.named_modules():
        if not name:
            continue
        for pattern, style in rules:
            if not pattern.match(f"{relative}.{name}") or style == "moe_tp_experts":
                continue  # moe_tp_experts marks where transformers reduces; we reduce at the block's output
            if not isinstance(module, nn.Linear):
                raise UnsupportedModel(f"{path}.{name}: tensor-parallel style {style!r} on a "
                                       f"{type(module).__name__}, not an nn.Linear")
            _linear_actions(plan, module, f"{path}.{name}", style)
            covered.update(f"{name}.{p}" for p, _ in module.named_parameters())
    for name, param in mlp.named_parameters():
        if name in covered:
            continue
        owner = name.rpartition(".")[0]
        style = next((s for pattern, s in rules if pattern.match(f"{relative}.{name}")), None)
        if style is not None:  # a bare Parameter the plan names: the experts' 3-D weights [E, out, in]
            splits = {"packed_colwise": Split(param.dim() - 2, 2), "colwise": Split(param.dim() - 2),
                      "rowwise": Split(param.dim() - 1)}
            if style not in splits:
                raise UnsupportedModel(f"{path}.{name}: tensor-parallel style {style!r} is not one unimem_compile "
                                       "applies (colwise, rowwise, packed_colwise)")
            plan.params[f"{path}.{name}"] = splits[style]
        elif owner == "gate":  # the MoE router: replicated, so every rank routes every token alike
            plan.replicated.append(f"{path}.{name}")
        else:
            raise UnsupportedModel(f"{path}.{name}: the model's tensor-parallel plan (config.base_model_tp_plan) "
                                   "has no rule for this parameter")
    for name, module in mlp.named_modules():
        target = f"{path}.{name}" if name else path
        for attr in ("intermediate_size", "intermediate_dim"):  # MLPs' and experts' widths
            size = getattr(module, attr, None)
            if isinstance(size, int):
                plan.attributes.append((target, attr, _local(f"{target} has {attr} {size}", size,
                                                             plan.world_size)))
    plan.reduce_outputs.append(path)


# ------------------------------------------------------------------------------------------- the model
def plan_model(model: nn.Module, world_size: int) -> TensorParallelPlan:
    """The tensor-parallel plan of ``model`` (a Kimi-Linear, DeepSeek-V3 or DeepSeek-V2 ``*ForCausalLM``)
    over ``world_size`` ranks; nothing is changed.

    Raises:
        GeometryError: ``world_size`` does not divide a dimension the plan cuts: the MLA or KDA heads of a
            layer, an MLP's or an expert's intermediate size (the message names the layer and the count).
        UnsupportedModel: the model has no ``model.layers``, a layer of another kind, or a parameter the
            plan has no rule for.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise GeometryError(f"world_size must be a positive int, got {world_size!r}")
    base_path = getattr(model, "base_model_prefix", "model")
    base = getattr(model, base_path, None)
    if base is None or not hasattr(base, "layers"):
        raise UnsupportedModel(f"{type(model).__name__} has no {base_path}.layers to cut over ranks")
    plan = TensorParallelPlan(world_size)
    config = model.config
    rules = _tp_plan_rules(config)
    kinds = set()
    for i, layer in enumerate(base.layers):
        path = f"{base_path}.layers.{i}"
        attn = layer.self_attn
        if _is_mla(attn):
            _plan_mla(plan, attn, f"{path}.self_attn", i)
            kinds.add("mla")
        elif _is_kda(attn):
            _plan_kda(plan, attn, f"{path}.self_attn", i)
            kinds.add("kda")
        else:
            raise UnsupportedModel(f"{path}.self_attn is a {type(attn).__name__}, neither MLA nor KDA")
        _plan_mlp(plan, layer.mlp, f"{path}.mlp", f"layers.{i}.mlp", rules)
        kinds.add("moe" if hasattr(layer.mlp, "experts") else "dense")
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.bias is None and head.out_features % world_size == 0:
        plan.params["lm_head.weight"] = Split(0)
        plan.gather_outputs.append("lm_head")
    elif head is not None:
        plan.notes.append(f"lm_head replicated: its {head.out_features} outputs do not divide over {world_size} "
                          "ranks" if isinstance(head, nn.Linear) and head.bias is None else
                          "lm_head replicated: not a bias-free nn.Linear")
    # the config describes the rank's shard, as the modules do: the pool's adapter reads linear_num_heads
    cut = {"mla": ("num_attention_heads", "num_key_value_heads"), "kda": ("linear_num_heads",),
           "dense": ("intermediate_size",), "moe": ("moe_intermediate_size",)}
    for key in (k for kind in sorted(kinds) for k in cut[kind]):
        count = getattr(config, key, None)
        if isinstance(count, int) and count % world_size == 0:
            plan.config[key] = count // world_size
        elif isinstance(count, int):
            plan.notes.append(f"config.{key} = {count} left as it is: it does not divide over {world_size} "
                              "ranks (the modules' own sizes are cut)")
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in plan.params and name not in plan.replicated:
            plan.replicated.append(name)
    return plan


def apply_plan(model: nn.Module, plan: TensorParallelPlan, rank: int, reduce_hook, gather_hook) -> None:
    """Cut ``model`` IN PLACE to rank ``rank``'s shard of ``plan``: every planned parameter is replaced by a
    new ``nn.Parameter`` holding its shard (the full tensor is freed once nothing else holds it), module
    attributes and the config get their local values, and ``reduce_hook`` / ``gather_hook`` (forward hooks
    ``(module, args, output) -> output``) are registered on the reduction / gather points."""
    with torch.no_grad():
        for name, action in plan.params.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            param = getattr(owner, leaf)
            if isinstance(action, Split):
                value = shard_tensor(param.detach(), action, rank, plan.world_size)
            else:  # BIAS_ON_RANK0
                value = param.detach().clone() if rank == 0 else torch.zeros_like(param)
            setattr(owner, leaf, nn.Parameter(value, requires_grad=param.requires_grad))
    for module_name, attr, value in plan.attributes:
        setattr(model.get_submodule(module_name), attr, value)
    for key, value in plan.config.items():
        setattr(model.config, key, value)
    for module_name in plan.reduce_outputs:
        model.get_submodule(module_name).register_forward_hook(reduce_hook)
    for module_name in plan.gather_outputs:
        model.get_submodule(module_name).register_forward_hook(gather_hook)
