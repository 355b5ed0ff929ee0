"""An OpenAI-compatible HTTP server over the continuous-batching engine (``unimem-compile serve``,
docs/serve.md).

Layers: :mod:`.protocol` (request bodies, error bodies), :mod:`.text` (tokenizers, chat templates,
incremental detokenisation, stop strings), :mod:`.engine` (the interface the HTTP layer needs from an
engine, and its implementation over the batching manager), :mod:`.app` (the Starlette app),
:mod:`.metrics` (Prometheus), :mod:`.server` (loading, uvicorn, shutdown).
"""

from .app import ServerState, create_app
from .engine import EngineClient, EngineMetrics, ManagerEngine, QueueFull, RequestRefused, Sampling, Update
from .server import ServeOptions, ServerThread, serve

__all__ = [
    "ServerState",
    "create_app",
    "EngineClient",
    "EngineMetrics",
    "ManagerEngine",
    "QueueFull",
    "RequestRefused",
    "Sampling",
    "Update",
    "ServeOptions",
    "ServerThread",
    "serve",
]
