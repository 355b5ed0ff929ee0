"""Per-step table uploads on CUDA: in stream order, and a decode step's preparation never synchronises.

- StagedUpload: with the stream held up by a long kernel, each upload is seen by exactly the work enqueued
  after it and before the next one (the staging ring is never overwritten early);
- UnifiedCache.prepare_step: after the first step, one-token steps (page boundaries and the pool tables'
  refresh included) run under ``torch.cuda.set_sync_debug_mode("error")``, and the device page table,
  ``kv_len`` and write locations then equal the host bookkeeping.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import unimem_compile  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402
from unimem_compile.pool.staging import StagedUpload  # noqa: E402


def test_uploads_are_seen_in_stream_order_behind_a_busy_stream():
    gen = torch.Generator().manual_seed(3)
    dst = torch.full((4096,), -1, dtype=torch.int64, device="cuda")
    upload = StagedUpload(dst, depth=2)
    sources = [torch.randint(0, 1 << 40, (4096,), generator=gen) for _ in range(7)]
    seen = []
    torch.cuda._sleep(200_000_000)  # hold the stream (~0.1 s) so every upload is queued behind it
    for src in sources:
        upload(src)
        seen.append(dst.clone())  # enqueued after this upload, before the next
    torch.cuda.synchronize()
    for i, (src, got) in enumerate(zip(sources, seen)):
        assert torch.equal(got.cpu(), src), f"the copy enqueued after upload {i} saw other data"


def test_one_token_steps_never_synchronise_and_tables_match_the_host():
    model = build_model("kimi-linear-tiny", dtype=torch.float32, device="cuda", seed=0)
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=40, page_size=4, backend="eager")
    cache = model.unimem.new_cache(3)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 1000, (3, 9), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    try:
        cache.prepare_step(ids, mask)  # the first step reads the mask on the host: synchronising is fine
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):  # crosses page boundaries: pages are allocated, the pool tables refreshed
                ids = torch.cat([ids, ids[:, -1:]], dim=1)
                mask = torch.cat([mask, torch.ones_like(mask[:, -1:])], dim=1)
                cache.prepare_step(ids, mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        pt = cache.page_tables
        positions = torch.tensor(pt.lengths, dtype=torch.int64) - 1
        assert torch.equal(pt.page_table.cpu(), pt._host_table)
        assert pt.kv_len.cpu().tolist() == pt.lengths == [19, 17, 19]
        assert cache.write_loc.cpu().reshape(-1).tolist() == pt.token_locations(positions).tolist()
        assert torch.equal(model.unimem.pool.v2p.cpu(), model.unimem.pool.allocator.v2p)
    finally:
        cache.release()
