"""The main job: stock transformers generate vs unimem-compile's compiled generate, side by side.

``unimem-compile demo`` builds a small model from a config with random weights (no downloads), encodes a
handful of English prompts with a byte-level tokenizer, and runs

1. stock transformers ``generate()`` (eager, its default cache): the reference tokens and speed;
2. ``unimem_compile.compile(model, ...)`` then ``generate()``: once to compile, then timed;

(each system timed over :data:`TIMED_RUNS` calls; the fastest decode counts, measured inside one call from
the end of the prefill step to the last step: by :class:`StepClock` for stock transformers, by the decode
runner's own clock (``model.unimem.timed_decode()``) for the compiled model, since a logits processor would
send the call to transformers' own loop)

then reports parity (fp32: greedy tokens identical; bf16: teacher-forced logits as close to an fp32 run
of the same weights as stock transformers' bf16 logits are, see BF16_ERROR_FACTOR; fp8 KV: teacher-forced
logits within :func:`fp8_sanity_bound` of stock transformers' at the model's dtype), warm
decode tokens/s of both, compile time, the pool's statistics, the rewrites made, and the achieved
bandwidth (bytes one decode step must move / its time).
"""

from __future__ import annotations

import copy
import time

import torch

__all__ = ["PROMPTS", "ByteTokenizer", "StepClock", "run_demo", "teacher_forced_logits", "decode_step_bytes",
           "compare_logits", "fp8_tolerance", "fp8_sanity_bound", "unit_roundoff"]

PROMPTS = (
    "The quick brown fox jumps over the lazy dog while",
    "Memory is the bottleneck of long-context serving because",
    "In a hybrid model, linear attention layers keep a fixed state",
    "Once upon a time, in a small village by the sea,",
)

#: bf16 parity: unimem's mean |logit error| against an fp32 run of the same weights may exceed stock
#: transformers' own bf16 error by at most this factor plus BF16_ERROR_SLACK. A fixed absolute bound on
#: |unimem - stock| does not work for MoE models: a one-ulp difference in a hidden state can flip a top-k
#: expert choice, which moves later logits by O(1) in either run (seen on an H200: 1.7 at the 4-layer
#: Kimi-Linear geometry), so both bf16 runs are measured against the fp32 truth instead.
BF16_ERROR_FACTOR = 1.25
BF16_ERROR_SLACK = 1e-3


class ByteTokenizer:
    """Bytes -> ids ``byte + 3`` (0 = pad, 1 = bos, 2 = eos)."""

    offset = 3
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def encode_batch(self, texts, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``(input_ids [B, T], attention_mask [B, T])`` with a bos token per row."""
        rows = [[self.bos_token_id] + [b + self.offset for b in t.encode("utf-8")] for t in texts]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        return ids.to(device), mask.to(device)

    def decode(self, ids) -> str:
        """Text of ``ids``; special tokens are dropped, and ids that are no printable ASCII byte show as '·'."""
        chars = []
        for i in ids:
            i = int(i)
            if i in (self.pad_token_id, self.bos_token_id, self.eos_token_id):
                continue
            b = i - self.offset
            chars.append(chr(b) if 32 <= b < 127 else "·")
        return "".join(chars)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """A logits processor that timestamps every generate() step and changes nothing.

    On CUDA each mark is an event recorded on the current stream (no synchronisation); on the CPU a
    ``time.perf_counter`` reading. ``mark()`` once before generate(); generate() then calls the clock once
    per step, after that step's forward: mark 1 ends the prefill, marks 2.. the decode steps.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.mark()
        return scores

    def elapsed(self, i: int, j: int) -> float:
        """Seconds from mark ``i`` to mark ``j`` (synchronises on CUDA)."""
        if self.cuda:
            self.marks[j].synchronize()
            return self.marks[i].elapsed_time(self.marks[j]) * 1e-3
        return self.marks[j] - self.marks[i]


def _timed_generate(model, ids, mask, new_tokens: int, device) -> tuple[torch.Tensor, float, float]:
    """One greedy generate(): ``(output ids, wall seconds of the call, seconds of its decode steps)`` (the
    decode figure runs from the end of the prefill step to the end of the last step, in one call, so it is
    never a difference of two separately timed calls). A compiled model is timed by its decode runner's
    clock, stock transformers by a :class:`StepClock`."""
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    start = time.perf_counter()
    if hasattr(model, "unimem"):
        with model.unimem.timed_decode() as timing, torch.no_grad():
            out = model.generate(ids, **kwargs)
        decode = timing.decode_seconds()
    else:
        clock = StepClock(device)
        clock.mark()
        with torch.no_grad():
            out = model.generate(ids, logits_processor=[clock], **kwargs)
        decode = clock.elapsed(1, len(clock.marks) - 1)
    _sync(device)
    return out, time.perf_counter() - start, decode


#: timed generate() calls per system in the demo; the fastest decode is reported
TIMED_RUNS = 3


def decode_step_bytes(model, adapter, batch: int, context: float) -> int:
    """Bytes one decode step must move at the least: every weight once (all experts, an upper bound for
    MoE), each row's cached latent rows (``context`` tokens x L x D x itemsize), and each row's state read
    and written once."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = int(batch * context * adapter.kv_spec.token_bytes) if adapter.kv_spec is not None else 0
    state = 2 * batch * adapter.state_spec.raw_bytes if adapter.state_spec is not None else 0
    return weights + kv + state


class _ForceTokens:
    """A logits processor that makes generate() pick the given tokens (teacher forcing)."""

    def __init__(self, continuation: torch.Tensor, prompt_len: int):
        self.continuation, self.prompt_len = continuation, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        target = self.continuation[:, input_ids.shape[1] - self.prompt_len]
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, target[:, None], 0.0)


def teacher_forced_logits(model, ids, mask, continuation) -> torch.Tensor:
    """Raw logits ``[B, N, vocab]`` (fp32) ``model`` produces at each of ``N`` generate() steps when it is
    made to pick the given ``continuation [B, N]`` (teacher forcing through the normal generate path)."""
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=continuation.shape[1], min_new_tokens=continuation.shape[1],
            do_sample=False, logits_processor=[_ForceTokens(continuation, ids.shape[1])], output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.stack([step.float() for step in out.logits], 1)


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far teacher-forced logits ``got`` lie from ``ref`` (both ``[B, N, vocab]``, fp32, the same forced
    tokens).

    Returns a dict: ``mean_abs`` / ``max_abs`` (|logit difference| over every logit), ``median_position``
    (the median over the ``B * N`` positions of each position's mean |difference|), ``kl_mean`` /
    ``kl_median`` (the KL divergence ``KL(softmax(ref) || softmax(got))`` of the next-token distributions,
    in nats, mean and median over positions), ``top1_agreement`` (fraction of positions whose argmax
    agrees) and ``positions``.
    """
    diff = (got - ref).abs()
    # in float64: the KL of a bf16-sized logit change (~1e-8) is below fp32's rounding of the sum
    log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)  # rounding can make a tiny KL negative
    return {
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
        "median_position": float(diff.mean(-1).median()),
        "kl_mean": float(kl.mean()),
        "kl_median": float(kl.median()),
        "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        "positions": int(kl.numel()),
    }


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next value of ``dtype``: the largest relative error of rounding a
    normal value to it (2^-8 for bf16, 2^-11 for fp16, 2^-4 for e4m3)."""
    return torch.finfo(dtype).eps / 2


#: Allowance for the sampling noise of a median over the demo's / the tests' positions (a few hundred) and
#: for second-order effects, on top of the first-order ratio in :func:`fp8_tolerance`.
FP8_NOISE_FACTOR = 2.0


def fp8_tolerance(fp8_dtype: torch.dtype, scale_dtype: torch.dtype, scale: dict) -> dict:
    """The bounds fp8 KV's teacher-forced logits are held to in the tests, against the run without it.

    ``scale`` is :func:`compare_logits` of a run whose KV rows alone are rounded to ``scale_dtype``, against
    the same reference. To first order the logits respond linearly to the rows' rounding errors, whose
    distribution has the same shape for every float format, scaled by its unit roundoff u (relative
    errors spread over +-u; e4m3's tile scale only picks which binade a value falls in); so the fp8 run's
    |logit errors| are ``r = unit_roundoff(fp8) / unit_roundoff(scale_dtype)`` times the scale run's (16
    against bf16) and its KL divergences, quadratic in the logit change, ``r^2`` times. Every bound gets
    :data:`FP8_NOISE_FACTOR` (squared for the KL). First order needs a smooth network: with top-k expert
    routing a perturbation above a router's margin flips an expert (an O(1) change that stays in the cache),
    and flips are too rare under bf16 rounding to be scaled, so these bounds hold for models without it
    (``build_model(..., dense_mlp=True)``); :func:`fp8_sanity_bound` is the demo's for the others.

    Returns ``{"ratio", "mean_abs", "max_abs", "median_position", "kl_mean", "kl_median"}``: the ratio and
    the bounds of those :func:`compare_logits` keys.
    """
    ratio = unit_roundoff(fp8_dtype) / unit_roundoff(scale_dtype)
    out = {"ratio": ratio}
    for key in ("mean_abs", "max_abs", "median_position"):
        out[key] = FP8_NOISE_FACTOR * ratio * scale[key]
    for key in ("kl_mean", "kl_median"):
        out[key] = (FP8_NOISE_FACTOR * ratio) ** 2 * scale[key]
    return out


def fp8_sanity_bound(fp8_dtype: torch.dtype, ref: torch.Tensor) -> dict:
    """The demo's bound on fp8 KV's teacher-forced logits for any model, top-k routed ones included.

    An fp8 row is the exact row times ``(1 + e)`` with ``|e| <= u = unit_roundoff(fp8_dtype)`` (2^-4) per
    value (ops/fp8.py), and the logits see the rows through attention (a convex combination of values,
    mixed into a residual stream that carries the rest), so at a typical position they should move by less
    than ``u`` times their own spread; a store read as another format (e4m3fnuz as e4m3fn doubles every
    latent) or a misread scale or rope moves them by about the whole spread. Typical = the median over
    positions, because an expert flip of a top-k router (an O(1) change that lives on in the cache) hits
    some positions whatever the precision. This is an order-of-magnitude check; the tests hold dense-MLP
    models to the linear-response bounds of :func:`fp8_tolerance`.

    Args:
        fp8_dtype: the KV format (an fp8 one; the demo also passes bf16 / fp16 for such rows of an fp32
            model: the same argument with that dtype's ``u``).
        ref: the reference run's logits ``[B, N, vocab]``.

    Returns:
        ``{"logit_spread", "median_position"}``: the median over positions of the mean ``|logit - its
        position's mean logit|`` of ``ref``, and ``u`` times it (the bound on :func:`compare_logits`'s
        ``median_position``).
    """
    spread = float((ref - ref.mean(-1, keepdim=True)).abs().mean(-1).median())
    return {"logit_spread": spread, "median_position": unit_roundoff(fp8_dtype) * spread}


class DemoArgumentError(ValueError):
    """A demo argument refused before anything runs."""


def run_demo(model_name: str = "kimi-linear-tiny", device: str = "cpu", dtype: torch.dtype | None = None,
             new_tokens: int = 24, backend: str = "inductor", page_size: int = 16, passes=True,
             cudagraphs: bool | None = None, log=print, kv_dtype=None) -> dict:
    """Run the side-by-side comparison and return the ``demo --json`` object (docs/design.md section 5).

    ``kv_dtype``: the compiled model's KV dtype (``compile(kv_dtype=...)``; None: the model's). An fp8 one
    makes parity the ``"fp8_logits"`` criterion: the compiled run's teacher-forced logits against stock
    transformers' (whose KV is the model's dtype: fp32 on the CPU, bf16 on CUDA) within
    :func:`fp8_sanity_bound`, with the comparison's figures (:func:`compare_logits`) in
    ``parity_detail["fp8_vs_reference"]``. Any other KV dtype with a larger unit roundoff than the model's
    (bf16 or fp16 rows of an fp32 model) makes it ``"kv_logits"``: the same comparison and bound at that
    dtype's roundoff, the figures in ``parity_detail["kv_vs_reference"]`` (greedy tokens may diverge from
    stock's on such rows for no fault of the pool's).

    Raises:
        DemoArgumentError (a ValueError): ``new_tokens`` below 2 (decode speed needs at least one decode
            step after the prefill token), ``page_size`` not positive, a ``backend`` torch.compile does
            not know, or a ``kv_dtype`` that names no dtype; checked before anything runs.
    """
    import transformers

    import unimem_compile
    from unimem_compile.hf.models import build_model

    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise DemoArgumentError(f"new_tokens must be an int >= 2 (one prefill token + at least one decode "
                                f"step), got {new_tokens!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise DemoArgumentError(f"page_size must be a positive int, got {page_size!r}")
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise DemoArgumentError(f"unknown torch.compile backend {backend!r}; known: {sorted(backends)}")
    from unimem_compile.options import kv_dtype_of
    from unimem_compile.pool.specs import FP8_KV_DTYPES

    try:
        kv_dtype = kv_dtype_of(kv_dtype)
    except TypeError as e:
        raise DemoArgumentError(str(e)) from None
    fp8_kv = kv_dtype in FP8_KV_DTYPES
    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    # KV rows rounded more coarsely than the model computes (fp8; bf16 / fp16 rows of an fp32 model): greedy
    # tokens may then diverge from stock's for a legitimate reason, so parity compares logits
    narrow_kv = fp8_kv or (kv_dtype is not None and unit_roundoff(kv_dtype) > unit_roundoff(dtype))
    tok = ByteTokenizer()
    model = build_model(model_name, dtype=dtype, device=dev)
    ids, mask = tok.encode_batch(PROMPTS, dev)
    batch, prompt = ids.shape

    # 1. stock transformers, eager, default cache (warm-up call first, then timed)
    _timed_generate(model, ids, mask, 2, dev)
    runs = [_timed_generate(model, ids, mask, new_tokens, dev) for _ in range(TIMED_RUNS)]
    ref_out = runs[0][0]
    ref_decode_t = min(r[2] for r in runs)
    forced = ref_out[:, prompt:]
    stock_logits = fp32_logits = None
    if narrow_kv:
        stock_logits = teacher_forced_logits(model, ids, mask, forced)
    elif dtype != torch.float32:
        stock_logits = teacher_forced_logits(model, ids, mask, forced)
        model32 = copy.deepcopy(model).float()  # the same weights, upcast exactly
        fp32_logits = teacher_forced_logits(model32, ids, mask, forced)
        del model32

    # 2. unimem-compile
    max_seq_len = prompt + new_tokens
    unimem_compile.compile(model, max_batch_size=batch, max_seq_len=max_seq_len, page_size=page_size,
                           backend=backend, passes=passes, cudagraphs=cudagraphs, kv_dtype=kv_dtype)
    first_out, first_t, _ = _timed_generate(model, ids, mask, new_tokens, dev)  # compiles prefill and decode
    runs = [_timed_generate(model, ids, mask, new_tokens, dev) for _ in range(TIMED_RUNS)]
    out = runs[0][0]
    warm_t = min(r[1] for r in runs)
    decode_t = min(r[2] for r in runs)

    tokens_identical = bool(all(torch.equal(r[0], ref_out) for r in runs) and torch.equal(first_out, ref_out))
    errors = fp8_detail = None
    if narrow_kv:
        got = teacher_forced_logits(model, ids, mask, forced)
        comparison = compare_logits(got, stock_logits)
        bound = fp8_sanity_bound(kv_dtype, stock_logits)
        criterion = "fp8_logits" if fp8_kv else "kv_logits"
        tolerance, max_diff = bound["median_position"], comparison["max_abs"]
        parity = comparison["median_position"] <= tolerance
        fp8_detail = {"kv_dtype": str(kv_dtype).replace("torch.", ""),
                      "reference": f"stock transformers, {str(dtype).replace('torch.', '')} KV",
                      ("fp8_vs_reference" if fp8_kv else "kv_vs_reference"): comparison,
                      "logit_spread": bound["logit_spread"]}
    elif dtype == torch.float32:
        criterion, tolerance, max_diff = "tokens", 0.0, None
        parity = tokens_identical
    else:
        got = teacher_forced_logits(model, ids, mask, forced)
        max_diff = float((got - stock_logits).abs().max())
        errors = {"unimem": float((got - fp32_logits).abs().mean()), "stock": float((stock_logits - fp32_logits).abs().mean())}
        criterion, tolerance = "logits", BF16_ERROR_FACTOR * errors["stock"] + BF16_ERROR_SLACK
        parity = errors["unimem"] <= tolerance

    decode_tokens = batch * (new_tokens - 1)
    mean_context = prompt + new_tokens / 2
    step_bytes = decode_step_bytes(model, model.unimem.adapter, batch, mean_context)
    result = {
        "model": model_name,
        "device": str(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parity": bool(parity),
        "parity_detail": {
            "criterion": criterion,
            "tokens_identical": tokens_identical,
            "max_abs_logit_diff": max_diff,
            "tolerance": tolerance,
        },
        "tokens_per_s": decode_tokens / decode_t,
        "reference_tokens_per_s": decode_tokens / ref_decode_t,
        "compile_s": max(0.0, first_t - warm_t),
        "achieved_bandwidth_gbs": step_bytes / (decode_t / (new_tokens - 1)) / 1e9,
        "pool": {k: v for k, v in model.unimem.stats().items() if k in (
            "total_bytes", "kv_pages_peak", "state_slots_peak", "kv_pages_used", "state_slots_used",
            "overhead_fraction")},
        "rewrites": model.unimem.rewrites,
    }
    if errors is not None:
        # bf16: tolerance bounds unimem's mean |logit - fp32 logit|, next to stock transformers' own
        result["parity_detail"]["mean_abs_error_vs_fp32"] = errors
    if fp8_detail is not None:
        # fp8 KV: tolerance bounds the median position's mean |logit - stock logit| (fp8_sanity_bound)
        result["parity_detail"].update(fp8_detail)
    texts = [(tok.decode(ids[i][mask[i].bool()]), tok.decode(out[i, prompt:])) for i in range(batch)]
    result["_texts"] = texts
    # for the text report (not a docs/design.md key): the compile estimate is a difference of noisy timings
    result["_generate_s"] = (first_t, warm_t)
    return result


def format_report(r: dict) -> str:
    """Human-readable report of :func:`run_demo`'s result."""
    lines = [f"model {r['model']} on {r['device']} ({r['dtype']}), torch {r['torch']}, "
             f"transformers {r['transformers']}",
             "greedy decoding (do_sample=False) of the same prompts by stock transformers generate() (eager, its "
             "default cache: the baseline) and by the same model after unimem_compile.compile()", ""]
    for prompt, cont in r.get("_texts", []):
        lines.append(f"  {prompt!r} -> {cont!r}")
    lines.append("  (random weights: the continuations are noise; what matters is that both generations agree)")
    d = r["parity_detail"]
    detail = ""
    if d["criterion"] == "logits":
        detail = (f", mean |logit - fp32| unimem {d['mean_abs_error_vs_fp32']['unimem']:.3g} vs stock "
                  f"{d['mean_abs_error_vs_fp32']['stock']:.3g} (bound {d['tolerance']:.3g}), max |unimem - stock| "
                  f"{d['max_abs_logit_diff']:.3g}")
    elif d["criterion"] in ("fp8_logits", "kv_logits"):
        c = d["fp8_vs_reference" if d["criterion"] == "fp8_logits" else "kv_vs_reference"]
        detail = (f"; {d['kv_dtype']} KV vs {d['reference']} over {c['positions']} positions: |logit diff| "
                  f"median position {c['median_position']:.3g} (bound {d['tolerance']:.3g}), mean "
                  f"{c['mean_abs']:.3g}, max {c['max_abs']:.3g}; KL mean {c['kl_mean']:.3g}; top-1 agreement "
                  f"{c['top1_agreement']:.3f}")
    lines += [
        "",
        f"parity              {'OK' if r['parity'] else 'FAILED'} ({d['criterion']}: tokens identical = "
        f"{d['tokens_identical']}{detail})",
        f"decode tokens/s     unimem-compile {r['tokens_per_s']:.1f}   stock transformers "
        f"{r['reference_tokens_per_s']:.1f}   ({r['tokens_per_s'] / r['reference_tokens_per_s']:.2f}x)"
        + ("   [CPU, tiny model: host overhead, not memory traffic; see benchmarks/RESULTS.md for GPU figures]"
           if r["device"] == "cpu" and r["model"].endswith("-tiny") else ""),
        f"compile time        {r['compile_s']:.1f} s (the first generate() call minus the fastest warm one"
        + (": {:.1f} s vs {:.1f} s)".format(*r["_generate_s"]) if "_generate_s" in r else ")"),
        f"achieved bandwidth  {r['achieved_bandwidth_gbs']:.2f} GB/s (weights + KV + states per decode step)",
        f"pool                {r['pool']['total_bytes']:,} bytes, peak {r['pool']['kv_pages_peak']} pages + "
        f"{r['pool']['state_slots_peak']} slots, now {r['pool']['kv_pages_used']} pages + "
        f"{r['pool']['state_slots_used']} slots, overhead {r['pool']['overhead_fraction']:.2%} (the arena's bytes "
        "no page or slot can use: sink, tail pad, alignment)",
        f"rewrites            {r['rewrites']}",
    ]
    return "\n".join(lines)

