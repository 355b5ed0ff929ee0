"""``unimem-compile serve``: load a model, compile it, start the batching engine, serve HTTP (uvicorn).

The HTTP server comes up first and answers ``/health`` with 503 while a background thread loads, compiles
and warms the model (one request through the engine), then 200. Shutdown (SIGINT / SIGTERM, handled by
uvicorn): the listener closes, running requests get ``shutdown_timeout`` seconds to finish, what is still
running then is cancelled (its streams end), the engine stops, and the process exits with status 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .app import ServerState, create_app
from .engine import EngineClient, ManagerEngine, Sampling
from .text import ByteCodec, HFCodec, TextCodec

__all__ = ["ServeOptions", "load_model", "build_engine", "warm_up", "make_server", "ServerThread", "free_port",
           "serve"]

log = logging.getLogger("unimem_compile.serve")


@dataclass(frozen=True)
class ServeOptions:
    """``unimem-compile serve``'s options (docs/serve.md).

    Attributes:
        model: a ``MODEL_PRESETS`` name (random weights, byte-level tokenizer) or a checkpoint folder
            (``from_pretrained``, its tokenizer and chat template).
        host, port: where to listen (127.0.0.1 unless told otherwise).
        device: "cuda" or "cpu"; None: cuda when available.
        dtype: "auto" (bf16 on CUDA, fp32 on the CPU), "bf16", "fp16", "fp32".
        max_batch_size: most requests in one engine step. max_seq_len: most tokens of one request.
        memory_budget: arena bytes, a fraction of free device memory, or None (compile()'s default).
        kv_dtype: compile()'s ``kv_dtype`` (None: the model's dtype).
        page_size: tokens per KV page. backend: the inner torch.compile backend.
        api_key: the bearer token ``/v1/*`` requires (None: none).
        max_queue: most requests waiting for admission before 429 (the manager's ``max_queue``).
        shutdown_timeout: seconds running requests get to finish after a signal.
        served_name: the model id clients name (default: the preset name or the folder's name).
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    device: Optional[str] = None
    dtype: str = "auto"
    max_batch_size: int = 32
    max_seq_len: int = 8192
    memory_budget: Optional[float] = None
    kv_dtype: Optional[str] = None
    page_size: int = 64
    backend: str = "inductor"
    api_key: Optional[str] = None
    max_queue: int = 256
    shutdown_timeout: float = 10.0
    served_name: Optional[str] = None
    log_level: str = "info"

    @property
    def name(self) -> str:
        return self.served_name or os.path.basename(os.path.normpath(self.model))


def load_model(options: ServeOptions):
    """``(model, codec)``: a preset with random weights and :class:`ByteCodec`, or a checkpoint folder
    through ``AutoModelForCausalLM.from_pretrained`` and its tokenizer (:class:`HFCodec`). ValueError for
    a name that is neither a preset nor a folder."""
    import torch

    from ..hf.models import MODEL_PRESETS, build_model

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = dtypes.get(options.dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)
    if options.model in MODEL_PRESETS:
        model = build_model(options.model, dtype=dtype, device=device)
        return model, ByteCodec(model.config.vocab_size)
    if not os.path.isdir(options.model):
        raise ValueError(f"--model {options.model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a "
                         "checkpoint folder")
    from transformers import AutoModelForCausalLM

    # loaded on the CPU, then moved: from_pretrained's device_map needs accelerate, which is no dependency
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return model, HFCodec.from_pretrained(options.model, eos)


def build_engine(model, options: ServeOptions) -> ManagerEngine:
    """Compile ``model`` (unimem_compile.compile with the options' limits) and start its batching manager."""
    import unimem_compile

    budget = options.memory_budget
    if budget is not None and budget > 1:
        budget = int(budget)
    unimem_compile.compile(model, max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len,
                           memory_budget=budget, page_size=options.page_size, kv_dtype=options.kv_dtype,
                           backend=options.backend)
    manager = model.init_continuous_batching(max_queue=options.max_queue)
    return ManagerEngine(manager, options.max_seq_len)


def warm_up(engine: EngineClient, codec: TextCodec, timeout: float = 600.0) -> None:
    """Run one short greedy request through the engine and wait for it, so the graphs of the first steps
    are compiled before ``/health`` says 200. RuntimeError if it fails or takes longer than ``timeout``."""
    done = threading.Event()
    result = {}

    def on_update(u):
        if u.finished:
            result["u"] = u
            done.set()

    engine.submit(codec.encode("warm up"), Sampling(max_new_tokens=4, temperature=0.0), on_update)
    if not done.wait(timeout):
        raise RuntimeError(f"the warm-up request did not finish within {timeout:g} s")
    if result["u"].status != "finished":
        raise RuntimeError(f"the warm-up request failed: {result['u'].error}")


def _lifespan(state: ServerState, load: Callable[[], tuple]):
    """Load in a thread when the server starts (so /health answers meanwhile); stop the engine at the end."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        def loader():
            try:
                t0 = time.perf_counter()
                codec, engine = load()
                state.codec, state.engine = codec, engine
                warm_up(engine, codec)
                state.ready = True
                log.info("model %s compiled and warm in %.1f s", state.model_name, time.perf_counter() - t0)
            except Exception as e:  # the server stays up and says why on /health
                state.load_error = f"{type(e).__name__}: {e}"
                log.exception("loading %s failed", state.model_name)

        thread = threading.Thread(target=loader, name="unimem-serve-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            state.shutting_down = True
            if state.engine is not None:
                state.engine.close(timeout=30.0)

    return lifespan


def make_server(state: ServerState, host: str, port: int, *, load: Optional[Callable[[], tuple]] = None,
                shutdown_timeout: float = 10.0, log_level: str = "warning"):
    """A ``uvicorn.Server`` over :func:`~.app.create_app`. ``load``: returns ``(codec, engine)``, run in a
    thread at startup; without it ``state`` must be served as it is (ready or not)."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    # streams must keep going during the graceful shutdown; uvicorn cancels what outlives its timeout
    AppStatus.disable_automatic_graceful_drain()
    app = create_app(state, lifespan=_lifespan(state, load) if load is not None else None)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on" if load else "auto")
    return uvicorn.Server(config)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """A server on a background thread of this process (tests, benchmarks); ``stop()`` shuts it down as a
    signal would, ``url`` is its base URL."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: Optional[int] = None, **kwargs):
        self.host, self.port = host, port or free_port(host)
        self.server = make_server(state, self.host, self.port, **kwargs)
        self.thread = threading.Thread(target=self.server.run, name="unimem-serve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout:g} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve(options: ServeOptions) -> int:
    """Run the server until SIGINT / SIGTERM; returns the exit status (0 after a clean shutdown)."""
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ServerState(model_name=options.name, max_seq_len=options.max_seq_len, api_key=options.api_key)

    def load():
        model, codec = load_model(options)
        return codec, build_engine(model, options)

    server = make_server(state, options.host, options.port, load=load, shutdown_timeout=options.shutdown_timeout,
                         log_level=options.log_level)
    # uvicorn re-raises the signal it shut down for once it is done; with these handlers that ends nothing,
    # so the process exits with status 0 after a clean shutdown instead of dying of the signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if state.load_error is None else 1
