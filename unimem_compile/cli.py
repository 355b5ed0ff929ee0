"""The ``unimem-compile`` command: ``demo``, ``pool-info``, ``inspect`` and ``serve`` (``python -m unimem_compile`` too)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys

__all__ = ["main"]

GIB = 1 << 30

#: what ``unimem-compile --help`` says (the module docstring is reST for the API docs)
DESCRIPTION = ("One memory arena for hybrid MLA + linear-attention Hugging Face models under torch.compile. "
               "demo: stock transformers generate() against the compiled model; pool-info: size an arena "
               "without allocating it; inspect: a graph before and after the rewrites; serve: an OpenAI-compatible "
               "server over the continuous-batching engine.")


def _config_geometry(path: str):
    """``(kv, state, name)`` of the model a transformers ``config.json`` (a file, or a folder holding one)
    describes, read offline through ``AutoConfig``; the rows in the config's dtype (bf16 when it names none).

    Raises:
        OSError: no config there; ValueError: not a transformers config; UnsupportedModel: a model family
            unimem_compile does not support, or a config that lacks what the pool needs."""
    import torch
    from transformers import AutoConfig

    from .hf.adapters import adapter_for_config

    if not os.path.exists(path):  # AutoConfig would read it as a Hub repo id and say "Repo id must be in the form..."
        raise FileNotFoundError("no such file or folder (a config.json, or the folder that holds one)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError("the folder holds no config.json")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    adapter = adapter_for_config(config, dtype)
    return adapter.kv_spec, adapter.state_spec, f"{config.model_type} from {path}"


def _kv_dtype(command: str, name: str):
    """``--kv-dtype NAME`` of ``command`` as compile(kv_dtype=NAME) takes it: ``(torch dtype, None)``, or
    ``(None, the error line)`` for a name that names no dtype or a dtype the MLA ops cannot store (the same
    refusals as compile(), before anything is built)."""
    from .options import kv_dtype_of
    from .pool.specs import KERNEL_KV_DTYPES

    try:
        dtype = kv_dtype_of(name)
    except TypeError as e:
        return None, f"unimem-compile {command}: --kv-dtype: {e}"
    if dtype not in KERNEL_KV_DTYPES:
        return None, (f"unimem-compile {command}: --kv-dtype {name!r} is {str(dtype).replace('torch.', '')}, which "
                      "the MLA ops cannot store; accepted: " + ", ".join(
                          str(d).replace("torch.", "") for d in KERNEL_KV_DTYPES) + " (or bf16, fp16, fp32, fp8_e4m3)")
    return dtype, None


#: the help of every command's --kv-dtype, after what it sets
KV_DTYPE_HELP = ("bf16, fp16, fp32, fp8_e4m3 (= fp8_e4m3fn, OCP e4m3), fp8_e4m3fnuz, or any other name "
                 "compile(kv_dtype=...) takes (bfloat16, float8_e4m3fn, torch.float16, ...)")


def _pool_info(args: argparse.Namespace) -> int:
    from .errors import GeometryError, UnsupportedModel
    from .pool import geometry, pool_info

    kv_dtype = None
    if args.kv_dtype is not None:
        kv_dtype, error = _kv_dtype("pool-info", args.kv_dtype)
        if error:
            print(error, file=sys.stderr)
            return 2
    if not 0 < args.budget_gib < math.inf:
        print(f"unimem-compile pool-info: --budget-gib must be a positive, finite number of GiB, got "
              f"{args.budget_gib:g}", file=sys.stderr)
        return 2
    if args.page_size <= 0:
        print(f"unimem-compile pool-info: --page-size must be a positive number of tokens, got {args.page_size}",
              file=sys.stderr)
        return 2
    if args.tp is not None and args.tp <= 0:
        print(f"unimem-compile pool-info: --tp must be a positive number of ranks, got {args.tp}", file=sys.stderr)
        return 2
    budget = int(args.budget_gib * GIB)
    if budget < 1:
        print(f"unimem-compile pool-info: --budget-gib {args.budget_gib:g} is less than one byte", file=sys.stderr)
        return 2
    if args.config is not None:
        try:
            kv, state, name = _config_geometry(args.config)
        except (OSError, ValueError, UnsupportedModel) as e:  # no such file, not a config, an unsupported model
            print(f"unimem-compile pool-info: --config {args.config}: {e}", file=sys.stderr)
            return 2
        args.geometry = name
    else:
        kv, state = geometry(args.geometry)
    if kv_dtype is not None and kv is not None:
        kv = dataclasses.replace(kv, dtype=kv_dtype)
    try:
        if args.tp is None:
            info = pool_info(kv, state, budget, args.page_size, geometry_name=args.geometry)
        else:
            from .tp.sizing import pool_info_tp

            info = pool_info_tp(kv, state, budget, args.page_size, args.tp, geometry_name=args.geometry)
    except GeometryError as e:  # e.g. a budget below one page envelope + one state slot
        print(f"unimem-compile pool-info: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    r = info["request_4096"]
    print(f"geometry            {info['geometry']}")
    print(f"budget              {info['budget_bytes']:,} bytes ({args.budget_gib:g} GiB)"
          + (f" per rank of {info['tp']}: full latent rows, 1/{info['tp']} of every state" if "tp" in info else ""))
    if kv is not None:
        print(f"KV rows             {str(kv.dtype).replace('torch.', '')}, {kv.entry_bytes:,} bytes per token per layer"
              + (" (fp8 latent + fp32 scale per 128 values + bf16 rope, padded to 16 bytes)" if kv.scaled_rows else ""))
    print(f"page size           {info['page_size']} tokens, {info['page_bytes']:,} bytes per page envelope")
    hybrid = info["slot_bytes"] > 0 and info["page_bytes"] > 0
    if info["slot_bytes"]:
        print(f"slot pitch          {info['slot_bytes']:,} bytes per request state")
    if info["page_bytes"]:
        print(f"max KV tokens       {info['max_kv_tokens']:,}" + (" (states take no room)" if hybrid else ""))
    if info["slot_bytes"]:
        print(f"max state slots     {info['max_state_slots']:,}" + (" (KV takes no room)" if hybrid else ""))
    print(f"overhead            {info['overhead_fraction']:.4%} of the budget (sink, tail pad, alignment)")
    for mix in info["mixes"]:
        print(f"  {mix['tokens_per_request']:>7,}-token requests: {mix['max_requests']:,} at once")
    line = (f"one 4096-token request: needs {r['bytes_needed']:,} B, this pool allocates {r['bytes_allocated']:,} B "
            f"(+{r['bytes_allocated'] / r['bytes_needed'] - 1:.2%})")
    if hybrid:  # padding attention blocks to the state size only exists when there are both
        padded = r["padded_group_bytes_allocated"]
        line += (f"; a hybrid allocator padding attention blocks to the state size allocates {padded:,} B "
                 f"(+{padded / r['bytes_needed'] - 1:.2%})")
    print(line)
    return 0


def _show_compile_log() -> None:
    """Print the compile log's INFO lines (one per graph compiled) on stderr, unless the program configured
    logging itself: the demo's first compiled generate() is otherwise a minute or two of silence on a CPU."""
    import logging

    log = logging.getLogger("unimem_compile.compile")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("unimem-compile: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import DemoArgumentError, format_report, run_demo

    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.kv_dtype is not None:
        _, error = _kv_dtype("demo", args.kv_dtype)
        if error:
            print(error, file=sys.stderr)
            return 2
    _show_compile_log()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("unimem-compile demo: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        result = run_demo(args.model, args.device, dtype, new_tokens=args.new_tokens, backend=args.backend,
                          page_size=args.page_size, passes=not args.no_passes, cudagraphs=args.cudagraphs,
                          kv_dtype=args.kv_dtype)
    except DemoArgumentError as e:  # refused before anything runs
        print(f"unimem-compile demo: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}, indent=2))
    else:
        print(format_report(result))
    return 0 if result["parity"] else 1


def _serve(args: argparse.Namespace) -> int:
    from .hf.models import MODEL_PRESETS
    from .serve.server import ServeOptions, serve

    # before the server starts: a typo would otherwise give a listening server whose /health says "failed"
    if args.model not in MODEL_PRESETS and not os.path.isdir(args.model):
        print(f"unimem-compile serve: --model {args.model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a "
              "checkpoint folder", file=sys.stderr)
        return 2
    for name in ("max_batch_size", "max_seq_len", "max_queue", "page_size"):
        if getattr(args, name) <= 0:
            print(f"unimem-compile serve: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    if not 0 <= args.port <= 65535:  # uvicorn's bind would raise OverflowError with a traceback, exit status 1
        print(f"unimem-compile serve: --port must be in [0, 65535] (0: any free port), got {args.port}",
              file=sys.stderr)
        return 2
    try:  # uvicorn's own failure says "[Errno -2] Name or service not known" without the name, after startup
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except OSError as e:
        print(f"unimem-compile serve: --host {args.host!r} is not an address this machine can listen on "
              f"({e.strerror or e})", file=sys.stderr)
        return 2
    if not 0 <= args.shutdown_timeout < math.inf:  # a negative or NaN one was taken, cutting every request
        print(f"unimem-compile serve: --shutdown-timeout must be a finite number of seconds >= 0, got "
              f"{args.shutdown_timeout:g}", file=sys.stderr)
        return 2
    if args.memory_budget is not None and not (0 < args.memory_budget < math.inf):
        print(f"unimem-compile serve: --memory-budget must be bytes (> 1) or a fraction in (0, 1], got "
              f"{args.memory_budget:g}", file=sys.stderr)
        return 2
    if args.memory_budget is not None and args.memory_budget > 1 and args.memory_budget != int(args.memory_budget):
        print(f"unimem-compile serve: --memory-budget above 1 is bytes and must be whole, got {args.memory_budget:g}",
              file=sys.stderr)
        return 2
    if args.kv_dtype is not None:
        _, error = _kv_dtype("serve", args.kv_dtype)
        if error:
            print(error, file=sys.stderr)
            return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():  # demo refuses it so too; the load would fail
        print("unimem-compile serve: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.backend not in backends:
        print(f"unimem-compile serve: --backend {args.backend!r} is not a torch.compile backend; known: "
              f"{', '.join(sorted(backends))}", file=sys.stderr)
        return 2
    options = ServeOptions(
        model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, memory_budget=args.memory_budget,
        kv_dtype=args.kv_dtype, page_size=args.page_size, backend=args.backend, api_key=args.api_key,
        max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout, served_name=args.served_model_name,
        log_level=args.log_level)
    return serve(options)


def build_parser() -> argparse.ArgumentParser:
    from .pool import GEOMETRIES

    import torch

    parser = argparse.ArgumentParser(prog="unimem-compile", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    from .hf.models import MODEL_PRESETS

    d = sub.add_parser("demo", help="stock transformers generate vs compiled unified-pool generate, side by side",
                       description="Greedy generate() of four English prompts by stock transformers (eager, its "
                                   "default cache: the baseline) and by the same model after "
                                   "unimem_compile.compile(), with parity, decode tokens/s of both, compile time "
                                   "and the pool's statistics.")
    d.add_argument("--model", default="kimi-linear-tiny", choices=list(MODEL_PRESETS),
                   help="a built-in model with random weights, no download (default kimi-linear-tiny; "
                        "kimi-linear-48b-4l / -8l: 4 / 8 layers at the real Kimi-Linear-48B geometry)")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs (default cpu)")
    d.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: fp32 on the CPU, bf16 on CUDA")
    d.add_argument("--new-tokens", type=int, default=24, help="tokens generated per prompt, >= 2 (default 24)")
    d.add_argument("--backend", default="inductor",
                   help="inner torch.compile backend (default inductor; aot_eager compiles in seconds); one of: "
                        + ", ".join(torch._dynamo.list_backends(exclude_tags=())))
    d.add_argument("--page-size", type=int, default=16,
                   help="tokens per KV page (default 16: the demo's prompts are short; compile() defaults to 64)")
    d.add_argument("--kv-dtype", default=None,
                   help="the compiled model's KV dtype (default: the model's): " + KV_DTYPE_HELP + "; an fp8 one: "
                        "scaled fp8 rows, parity then compares teacher-forced logits with stock transformers'")
    d.add_argument("--no-passes", action="store_true", help="compile without the graph rewrites")
    d.add_argument("--cudagraphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for decode (default: on for CUDA, off elsewhere)")
    d.add_argument("--json", action="store_true", help="print one JSON object (docs/design.md section 5 keys)")
    d.set_defaults(func=_demo)

    p = sub.add_parser("pool-info", help="size an arena for a model geometry (no memory is allocated)")
    p.add_argument("--geometry", default="kimi-linear-48b", choices=sorted(GEOMETRIES),
                   help="a built-in geometry: the real Kimi-Linear-48B-A3B (7 MLA + 20 KDA layers) or DeepSeek-V3 "
                        "(61 MLA layers), bf16 rows (default kimi-linear-48b)")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="size the model a transformers config.json describes (the file or its folder, read "
                        "offline) instead of --geometry")
    p.add_argument("--budget-gib", type=float, default=40.0, help="arena size in GiB (default 40)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page (default 64)")
    p.add_argument("--kv-dtype", default=None,
                   help="KV dtype of the geometry's MLA rows (default: the geometry's, bf16): " + KV_DTYPE_HELP
                        + "; an fp8 one sizes scaled fp8 rows (656 bytes per token and layer at 512 + 64)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree: the figures of ONE rank's arena of --budget-gib (full latent rows, "
                        "1/N of the KDA heads' states); the JSON gains the key tp")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_pool_info)

    from . import inspect_graphs

    p = sub.add_parser("inspect", help="print one MLA layer's decode (or prefill) graph before and after the rewrites",
                       description="Compile a built-in model with random weights and print its first MLA layer's "
                                   "decode (or prefill) graph as Dynamo captured it and after the rewrites, with "
                                   "each rewrite's count.")
    inspect_graphs.add_arguments(p)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the batching engine (docs/serve.md)")
    s.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(MODEL_PRESETS)}: random weights, byte-level tokenizer) or a "
                        "checkpoint folder (from_pretrained, its tokenizer and chat template)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    s.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on CUDA, fp32 on the CPU")
    s.add_argument("--max-batch-size", type=int, default=32, help="most requests in one engine step (default 32)")
    s.add_argument("--max-seq-len", type=int, default=8192,
                   help="most tokens of one request, prompt + reply (default 8192, not the model's position limit)")
    s.add_argument("--memory-budget", type=float, default=None,
                   help="arena bytes (> 1) or a fraction in (0, 1] of free device memory (default: compile()'s)")
    s.add_argument("--kv-dtype", default=None,
                   help="dtype of the cached latent rows (default: the model's): " + KV_DTYPE_HELP
                        + "; checked before listening")
    s.add_argument("--page-size", type=int, default=64, help="tokens per KV page (default 64)")
    s.add_argument("--backend", default="inductor", help="inner torch.compile backend (default inductor)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="most requests waiting for admission; past it 429 with Retry-After (default 256)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGINT / SIGTERM (default 10)")
    s.add_argument("--served-model-name", default=None, help="the model id clients name (default: --model's name)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
