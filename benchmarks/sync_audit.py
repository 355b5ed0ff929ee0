"""Every host <-> GPU synchronisation of a chunked prefill and of an engine burst, with the code that made it.

A synchronisation (a blocking copy, ``.item()``, a read-back, a boolean index on a CUDA tensor) makes the
host wait for every kernel queued before it: the host can no longer prepare step n+1 while the GPU runs
step n, and a host-bound prefill then costs host time plus GPU time instead of the larger of the two.
torch reports each one under ``torch.cuda.set_sync_debug_mode("warn")`` as a warning raised where Python
called into torch; this script records the Python stack of each and prints them grouped, with counts (and
the per-step table uploads that waited for a staging buffer, an event wait torch does not report), for
two prompt lengths (a synchronisation whose count grows with the chunks happens per chunk) and for the
engine's prefill of a burst of prompts (``generate_batch``).

    python benchmarks/sync_audit.py [--model kimi-linear-tiny] [--chunk 64] [--out sync_audit.json]

Needs CUDA. The tiny models run the same cache, mask and engine code as the real-geometry ones (not
flash-linear-attention's kernels, whose own host work ops/kda_graphs replays from graphs).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import warnings

import torch

import unimem_compile
from unimem_compile.hf.models import build_model
from unimem_compile.pool.staging import StagedUpload

#: path fragments that name our code or transformers' in a stack (the frames kept in a site's summary)
KEEP = ("unimem_compile", "transformers", "benchmarks/")
#: frames of a site's summary, innermost last
FRAMES = 4


def _site(stack: list[traceback.FrameSummary]) -> str:
    frames = [f for f in stack if any(k in f.filename for k in KEEP) and "sync_audit" not in f.filename]
    parts = [f"{f.filename.split('site-packages/')[-1].split('/tmp/unimem_shim/')[-1]}:{f.lineno} {f.name}"
             for f in frames[-FRAMES:]]
    return " <- ".join(reversed(parts)) or "(no frame of ours)"


class SyncRecorder:
    """Inside the ``with``: every synchronising CUDA call's site (see :func:`_site`), counted, and
    ``staged_waits``: the per-step table uploads that waited for their staging buffer's last copy
    (``StagedUpload.waits``: event waits, which torch's sync debug mode does not report)."""

    def __enter__(self):
        self.sites: collections.Counter = collections.Counter()
        self._waits_before = StagedUpload.waits
        self.staged_waits = 0
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                self.sites[_site(traceback.extract_stack()[:-1])] += 1
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self.staged_waits = StagedUpload.waits - self._waits_before
        self._catch.__exit__(*exc)
        return False


def _report(title: str, rec: SyncRecorder) -> dict:
    sites = rec.sites
    print(f"--- {title}: {sum(sites.values())} synchronisations at {len(sites)} sites, {rec.staged_waits} staged "
          "uploads that waited")
    for site, n in sites.most_common():
        print(f"{n:5d}  {site}")
    return {"sites": [{"count": n, "site": s} for s, n in sites.most_common()], "staged_waits": rec.staged_waits}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-linear-tiny")
    ap.add_argument("--chunk", type=int, default=64, help="prefill_chunk_size")
    ap.add_argument("--chunks", type=int, nargs=2, default=(2, 6), help="the two prompt lengths, in chunks")
    ap.add_argument("--burst", type=int, default=6, help="prompts of the engine burst (0: none)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_audit needs CUDA")
        return 2
    longest = max(args.chunks) * args.chunk
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    unimem_compile.compile(model, max_batch_size=8, max_seq_len=longest + 16, page_size=16, backend=args.backend)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    record: dict = {"model": args.model, "chunk": args.chunk, "backend": args.backend, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(), "generate": {}}

    def run(n_chunks: int):
        ids = torch.randint(3, vocab, (1, n_chunks * args.chunk), generator=gen).cuda()
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                  prefill_chunk_size=args.chunk)

    for n in args.chunks:
        run(n)  # compile and warm up this shape first
        with SyncRecorder() as rec:
            run(n)
        record["generate"][str(n)] = _report(f"generate(), one row of {n} chunks of {args.chunk}", rec)
    if args.burst:
        prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
                   for n in torch.randint(args.chunk // 2, 3 * args.chunk, (args.burst,), generator=gen)]
        model.generate_batch(prompts, max_new_tokens=2)  # warm up
        with SyncRecorder() as rec:
            model.generate_batch(prompts, max_new_tokens=2)
        record["generate_batch"] = _report(f"generate_batch() of {args.burst} prompts, 2 new tokens each", rec)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
