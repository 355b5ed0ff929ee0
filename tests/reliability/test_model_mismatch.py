"""A pool whose specs disagree with the model: a cache made for another compiled model is refused before
anything is allocated or written, in both pools."""

import pytest
import torch

import unimem_compile
from unimem_compile.errors import UnsupportedModel
from unimem_compile.hf.models import build_model


def _pool_state(model) -> list[torch.Tensor]:
    pool = model.unimem.pool
    return [t.clone() for t in (pool.arena, pool.v2p, pool.p2v, pool.s_v2p, pool.s_p2v)]


@pytest.fixture(scope="module")
def models():
    kimi = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=2, max_seq_len=32, page_size=8,
                                  backend="eager")
    deepseek = unimem_compile.compile(build_model("deepseek-v3-tiny"), max_batch_size=2, max_seq_len=32, page_size=8,
                                      backend="eager")
    return {"kimi-linear-tiny": kimi, "deepseek-v3-tiny": deepseek}


@pytest.mark.parametrize("model_name,cache_of", [("kimi-linear-tiny", "deepseek-v3-tiny"),
                                                 ("deepseek-v3-tiny", "kimi-linear-tiny")])
def test_a_cache_of_another_model_is_refused_and_changes_neither_pool(models, model_name, cache_of):
    model, other = models[model_name], models[cache_of]
    cache = other.unimem.new_cache(1)
    before = [_pool_state(model), _pool_state(other)]
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
    other_class = type(other).__name__
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(UnsupportedModel, match=rf"this UnifiedCache belongs to another compiled model "
                                                   rf"\(UnimemHandle\({other_class}, UnifiedPool\("
                                                   rf"{other.unimem.pool.layout.memory_budget} bytes"):
            model.generate(ids, past_key_values=cache, max_new_tokens=3)
        # the same refusal on a hand-written decode loop that calls prepare_inputs_for_generation directly
        with pytest.raises(UnsupportedModel, match="belongs to another compiled model"):
            model.prepare_inputs_for_generation(ids, past_key_values=cache)
    for was, now in zip(before, [_pool_state(model), _pool_state(other)]):
        assert all(torch.equal(a, b) for a, b in zip(was, now))
    cache.release()
    # the model's own cache still works afterwards
    own = model.unimem.new_cache(1)
    with torch.compiler.set_stance("force_eager"):
        out = model.generate(ids, past_key_values=own, max_new_tokens=3, do_sample=False)
    own.release()
    assert out.shape == (1, 9)
    assert model.unimem.stats()["kv_pages_used"] == 0 and other.unimem.stats()["kv_pages_used"] == 0
