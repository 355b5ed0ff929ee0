"""The op contract stated once: the six names of ``MLAGeometry`` are the schema tail of every MLA op, and
every state op's declared slot footprint names arguments of its own schema and gives its section's bytes."""

import pytest
import torch

from unimem_compile.ops.common import SLOT_ARGUMENTS, SLOT_FOOTPRINTS
from unimem_compile.ops.geometry import MLAGeometry
from unimem_compile.pool import MLASpec

MLA_OPS = ("mla_kv_write", "mla_kv_write_rmsnorm", "mla_gather", "mla_decode")
STATE_OPS = ("state_gather", "state_scatter", "causal_conv1d_update", "kda_decode", "kda_prefill")


def _argument_names(op: str) -> list[str]:
    return [a.name for a in getattr(torch.ops.unimem, op).default._schema.arguments]


@pytest.mark.parametrize("op", MLA_OPS)
def test_the_geometry_is_the_schema_tail_of_every_mla_op(op):
    assert tuple(_argument_names(op)[-6:]) == MLAGeometry.NAMES


def test_a_geometry_gives_its_values_in_schema_order_and_changes_only_the_layer():
    spec = MLASpec(layer_num=7, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
    g = MLAGeometry.of(spec, 64, layer=3)
    assert g.args() == (3, 7, 64, 512, 64, torch.bfloat16)
    assert g.for_layer(5).args() == (5, 7, 64, 512, 64, torch.bfloat16)
    assert MLAGeometry.from_arguments(dict(zip(MLAGeometry.NAMES, g.args()), max_len=9)) == g
    assert (g.row_width, g.row_bytes) == (576, 1152)


@pytest.mark.parametrize("op", STATE_OPS)
def test_every_state_op_declares_a_footprint_over_its_own_arguments(op):
    footprint = SLOT_FOOTPRINTS[f"unimem::{op}"]
    names = set(_argument_names(op))
    assert footprint.offset in names and set(SLOT_ARGUMENTS) <= names


def test_the_footprints_count_the_bytes_of_the_section_each_call_touches():
    gen = torch.Generator().manual_seed(3)
    b, t, h, dk, dv, c, k = (int(x) for x in torch.randint(2, 9, (7,), generator=gen))
    nbytes = {op: SLOT_FOOTPRINTS[f"unimem::{op}"].nbytes for op in STATE_OPS}
    assert nbytes["state_gather"]({"shape": [h, dk, dv], "dtype": torch.float32}) == h * dk * dv * 4
    assert nbytes["state_scatter"]({"value": torch.empty(b, c, k, dtype=torch.bfloat16)}) == c * k * 2
    assert nbytes["causal_conv1d_update"]({"x": torch.empty(b, c, dtype=torch.float16),
                                           "weight": torch.empty(c, k)}) == c * k * 2
    decode = {"q": torch.empty(b, h, dk), "v": torch.empty(b, h, dv)}
    prefill = {"q": torch.empty(b, t, h, dk), "v": torch.empty(b, t, h, dv)}
    assert nbytes["kda_decode"](decode) == nbytes["kda_prefill"](prefill) == h * dk * dv * 4
    assert nbytes["state_scatter"]({"value": None}) is None  # unknown in a graph: the caller assumes overlap
