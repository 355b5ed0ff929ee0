"""Prefill graph size and compile count of tiny Kimi-Linear: transformers' own KDA functions vs the adapter.

transformers runs its KDA prefill (``chunk_kimi_delta_attention``) as a pure-torch loop over 64-token
chunks when flash-linear-attention is absent; Dynamo unrolls it, so the graph grows with the prompt and a
new chunk count recompiles. The adapter (``unimem_compile.hf.adapters``) swaps in one opaque
``unimem::kda_chunk`` op. This script compiles the model twice with ``unimem_compile.compile`` (backend
"eager": only Dynamo's capture matters here, no rewrites), once with the adapter's patches disabled
("stock") and once with them ("adapter"), runs prefill-only ``generate`` calls for prompts of 12, 70 and
140 tokens in that order on the same model, and records per prompt the graphs Dynamo compiled and the
node count of each.

    python benchmarks/prefill_graphs.py --out prefill_graphs.json    # CPU, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import time
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import unimem_compile  # noqa: E402
from unimem_compile.hf.adapters import ModelAdapter  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402


def measure(mode: str, prompts: list[int], batch: int) -> list[dict]:
    """Per prompt length: ``{"prompt", "compiles", "nodes": [node count of each new graph], "ops", "s"}``."""
    torch._dynamo.reset()
    model = build_model("kimi-linear-tiny", dtype=torch.float32)
    unimem_compile.compile(model, max_batch_size=batch, max_seq_len=max(prompts) + 1, page_size=16,
                           backend="eager", passes=False)
    manager = model.unimem.passes
    graphs: list[tuple[int, int]] = []
    apply = manager.apply

    def counting_apply(gm):
        ops = sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)
        graphs.append((len(gm.graph.nodes), ops))
        return apply(gm)

    manager.apply = counting_apply
    g = torch.Generator().manual_seed(0)
    rows = []
    patch = mock.patch.object(ModelAdapter, "kernel_patches", lambda self: {}) if mode == "stock" else mock.MagicMock()
    with patch:
        for length in prompts:
            ids = torch.randint(3, 1000, (batch, length), generator=g)
            seen = len(graphs)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            new = graphs[seen:]
            rows.append({"prompt": length, "compiles": len(new), "nodes": [n for n, _ in new],
                         "ops": [o for _, o in new], "s": round(time.perf_counter() - start, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[12, 70, 140])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    import transformers

    result = {"model": "kimi-linear-tiny", "torch": torch.__version__, "transformers": transformers.__version__,
              "batch": args.batch, "backend": "eager (Dynamo capture only)", "modes": {}}
    for mode in ("stock", "adapter"):
        result["modes"][mode] = measure(mode, args.prompts, args.batch)
    print(f"{'mode':8} {'prompt':>6} {'compiles':>8} {'nodes (ops) per new graph':>28} {'s':>7}")
    for mode, rows in result["modes"].items():
        for r in rows:
            shown = ", ".join(f"{n} ({o})" for n, o in zip(r["nodes"], r["ops"])) or "-"
            print(f"{mode:8} {r['prompt']:>6} {r['compiles']:>8} {shown:>28} {r['s']:>7}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
