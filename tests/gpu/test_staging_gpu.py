"""Per-step table uploads on CUDA: in stream order, and a decode step's preparation never synchronises.

- StagedUpload: with the stream held up by a long kernel, each upload is seen by exactly the work enqueued
  after it and before the next one (the staging ring is never overwritten early);
- UnifiedCache.prepare_step: after the first step, one-token steps (page boundaries and the pool tables'
  refresh included) run under ``torch.cuda.set_sync_debug_mode("error")``, and the device page table,
  ``kv_len`` and write locations then equal the host bookkeeping;
- ``staging.upload`` and a chunked prefill's steps with a remembered mask: no synchronisation either, the
  device tables equal to the host's (and ``UNIMEM_ASYNC_UPLOADS=0`` does synchronise).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import unimem_compile  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402
from unimem_compile import env  # noqa: E402
from unimem_compile.pool.staging import StagedUpload, upload  # noqa: E402


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


def test_upload_enqueues_without_a_sync_and_keeps_its_own_copy():
    gen = torch.Generator().manual_seed(11)
    src = torch.randint(-(1 << 40), 1 << 40, (3, 257), generator=gen)
    want = src.clone()
    torch.cuda._sleep(100_000_000)  # the copy is queued behind a busy stream
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = upload(src, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    src.fill_(7)  # the caller may reuse its tensor at once: the pinned copy is upload's own
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    pinned = want.pin_memory()  # already pinned: upload still copies it (pin_memory() would return it itself)
    torch.cuda._sleep(100_000_000)
    got = upload(pinned, "cuda")
    pinned.fill_(5)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("async_uploads", ["1", "0"])
def test_prefill_chunks_never_synchronise_with_a_remembered_mask(async_uploads):
    """A chunked prefill's steps (generate() remembers the call's mask): the first chunk allocates the slots
    and uploads the rows, every chunk uploads its write locations, and each reads its pads from the host
    copy of the mask. ``UNIMEM_ASYNC_UPLOADS=0`` (the blocking copies and the read-back) must synchronise."""
    model = build_model("kimi-linear-tiny", dtype=torch.float32, device="cuda", seed=0)
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=40, page_size=4, backend="eager")
    cache = model.unimem.new_cache(2)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 1000, (2, 22), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # row 1's pads continue into the second chunk
    cache.chunked_prefill_end = 22
    cache.remember_mask(mask)
    torch.cuda.synchronize()
    try:
        with env.overridden(env.ASYNC_UPLOADS, async_uploads):
            for start in range(0, 22, 8):
                end = min(start + 8, 22)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    if async_uploads == "0":
                        with pytest.raises(RuntimeError, match="synchroniz"):
                            cache.prepare_step(ids[:, start:end], mask[:, :end])
                        return
                    cache.prepare_step(ids[:, start:end], mask[:, :end])
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                pt, loc, width = cache.page_tables, cache.write_loc.cpu(), end - start
                for b, pad in enumerate((0, 11)):  # row b's new tokens: stored indices old .. old + count
                    old, count = max(start - pad, 0), max(end - max(start, pad), 0)
                    want = pt.locations(b, old, count).tolist() if count else []
                    assert loc[b, width - count:].tolist() == want and (loc[b, :width - count] == -1).all()
                cache.prepared = False  # no forward runs here
        assert pt.lengths == [22, 11]
        assert cache.buffers.slot_ids.cpu().tolist() == cache.slots
        assert cache.buffers.out_offset.cpu().tolist() == [0, 11]
    finally:
        cache.release()


def test_a_chunked_generate_synchronises_as_often_for_two_chunks_as_for_six():
    """Nothing in a prefill chunk makes the host wait for the GPU (benchmarks/sync_audit.py's recorder: every
    synchronising call under ``set_sync_debug_mode("warn")``, by Python stack): a generate() of one row in six
    chunks synchronises exactly as often as one in two (the call's own checks, its first step and its result)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sync_audit.py")
    spec = importlib.util.spec_from_file_location("_sync_audit", path)
    audit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(audit)
    model = build_model("kimi-linear-tiny", dtype=torch.bfloat16, device="cuda", seed=0)
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=6 * 32 + 16, page_size=16, backend="aot_eager")
    gen = torch.Generator().manual_seed(13)
    counts, waits = {}, {}
    for chunks in (2, 6):
        ids = torch.randint(3, 1000, (1, chunks * 32), generator=gen).cuda()
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, prefill_chunk_size=32)
        with torch.no_grad():
            model.generate(ids, **kw)  # compiles
            with audit.SyncRecorder() as rec:
                model.generate(ids, **kw)
        counts[chunks] = rec.sites
        waits[chunks] = rec.staged_waits
    grown = {site: n for site, n in (counts[6] - counts[2]).items() if n}
    assert not grown, f"synchronisations per chunk: {grown}"
    assert waits[6] == waits[2], f"staged uploads that waited: {waits}"  # event waits the debug mode misses
