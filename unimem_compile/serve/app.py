"""The ASGI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, plus
``/health`` and ``/metrics`` (Starlette; server-sent events by sse-starlette).

A request's life: authenticate (``--api-key``: 401 before anything else), parse and validate the body
(:mod:`.protocol`: 400 naming the field), tokenise, check it against ``max_seq_len`` (400 with the
numbers), submit one engine request per choice (429 + ``Retry-After`` when the engine is full), then turn
the engine's token updates into text (:class:`~.text.IncrementalDetokenizer`, :class:`~.text.StopMatcher`)
and send it, as one JSON body or as SSE chunks. Updates arrive on the engine's thread and are handed to
the event loop through one mailbox per loop (:class:`_Mailbox`: one ``call_soon_threadsafe`` per batch of
updates, not one per update); each request drains every update waiting when it wakes, so a busy server
sends several tokens per event instead of one event per token. A client that goes away
(a closed stream, or a dropped connection while a non-streamed request runs) cancels its engine
requests, which frees their memory at the engine's next step.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Optional

from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .engine import EngineClient, QueueFull, RequestRefused, Sampling, Update
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from .text import ChatTemplateMissing, ChatTemplateRefused, IncrementalDetokenizer, StopMatcher, TextCodec

__all__ = ["ServerState", "create_app"]

log = logging.getLogger("unimem_compile.serve")

# prompt ids decoded as context in front of a reply, so its first token is spelled as inside the sequence
_PROMPT_CONTEXT_TOKENS = 4


@dataclass
class ServerState:
    """What the app serves. ``engine`` is None and ``ready`` False while the model loads; ``/health``
    answers 200 only when ``ready`` and not ``shutting_down``.

    Attributes:
        model_name: the id ``/v1/models`` lists and requests must name.
        codec: the tokenizer.
        max_seq_len: most tokens (prompt + reply) of one request.
        api_key: the bearer token ``/v1/*`` requires, None: no authentication.
        retry_after_s: the ``Retry-After`` (whole seconds) of a 429 or a 503 while loading.
    """

    model_name: str
    codec: Optional[TextCodec] = None
    max_seq_len: int = 0
    api_key: Optional[str] = None
    engine: Optional[EngineClient] = None
    ready: bool = False
    shutting_down: bool = False
    load_error: Optional[str] = None
    retry_after_s: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Optional[ServerMetrics] = None


class _Choice:
    """One choice of a response: its engine request and the text made so far."""

    def __init__(self, index: int, codec: TextCodec, prompt_ids: list[int], stops: list[str], max_new: int,
                 min_tokens: Optional[int] = None):
        self.index = index
        self.min_tokens = min_tokens or 0  # stop strings end the reply from this many tokens on (vLLM's rule)
        self.codec = codec
        self.prompt_ids = prompt_ids
        self.max_new = max_new
        self.detok = IncrementalDetokenizer(codec.decode, prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.stop = StopMatcher(stops)
        self.request_id: Optional[str] = None
        self.seen = 0  # generated tokens consumed
        self.text_parts: list[str] = []
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def take(self, update: Update) -> str:
        """The new text of ``update`` (cumulative tokens); sets ``finish_reason`` when the choice ends
        (``"stop"``: an EOS token or a stop string; ``"length"``: ``max_tokens`` or ``max_seq_len``).

        :attr:`seen` counts the reply's tokens: up to and including the EOS token or the token whose text
        completed a stop string (OpenAI's and vLLM's ``completion_tokens``); tokens the engine generated
        past either (a decode block runs several steps) are no part of the reply."""
        if self.done:
            return ""
        new = list(update.generated_tokens[self.seen:])
        eos = next((i for i, t in enumerate(new) if t in self.codec.eos_token_ids), None)
        if eos is not None:  # the EOS token ends the reply; it is no text
            new = new[:eos]
        # with stop strings, one token at a time: the token that completes a match is the reply's last
        pieces = [[t] for t in new] if self.stop.stops else [new]
        text = ""
        for piece in pieces:
            armed = self.seen + len(piece) >= self.min_tokens
            text += self.stop.push(self.detok.push(piece), armed=armed)
            self.seen += len(piece)
            if self.stop.stopped:
                break
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif update.status == "failed":
            self.error = update.error or "the engine failed this request"
        elif update.finished or eos is not None:
            if eos is not None:
                self.seen += 1  # counted in completion_tokens, as OpenAI counts it
            text += self.stop.push(self.detok.flush())
            text += self.stop.flush()
            self.finish_reason = "stop" if (eos is not None or self.stop.stopped or self.seen < self.max_new) \
                else "length"
        self.text_parts.append(text)
        return text


class _Mailbox:
    """Updates from the engine's thread to one event loop, with ONE loop wake-up per batch.

    ``post`` (any thread) appends to a deque and schedules :meth:`_drain` with ``call_soon_threadsafe``
    only when no drain is pending, so an engine step that updates R requests costs one wake-up of the loop
    (one write to its self-pipe), not R. ``_drain`` (the loop) hands each update to its request's queue.
    An update posted while a drain runs schedules the next one (``_pending`` is cleared before the deque
    is read), so none is left behind."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._updates: collections.deque = collections.deque()
        self._pending = False

    def post(self, queue: asyncio.Queue, update: Update) -> None:
        self._updates.append((queue, update))
        if not self._pending:
            self._pending = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody reads these any more
                self._pending = False

    def _drain(self) -> None:
        self._pending = False
        updates = self._updates
        while updates:
            queue, update = updates.popleft()
            queue.put_nowait(update)


_mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = _Mailbox(loop)
    return box


class _Generation:
    """The engine requests behind one HTTP request, and the queue their updates arrive on."""

    def __init__(self, state: ServerState, choices: list[_Choice], sampling: list[Sampling]):
        self.state = state
        self.choices = choices
        self.sampling = sampling
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.mailbox = _mailbox(self.loop)
        self.by_rid: dict[str, _Choice] = {}
        self.start = time.monotonic()
        self.first_text_at: Optional[float] = None

    def submit(self) -> None:
        engine = self.state.engine
        # every choice (prompts x n) waits in the engine's queue on its own: more of them than the queue holds
        # could never all be admitted, so a 429 (retry later) would be answered forever
        limit = getattr(engine, "max_queue", None)
        if limit is not None and len(self.choices) > limit:
            raise APIError(400, f"this request asks for {len(self.choices)} completions (prompts x n), more than "
                           f"the {limit} requests the server queues at a time (--max-queue); send fewer per request",
                           param="n", code="invalid_value")
        for choice, sampling in zip(self.choices, self.sampling):
            def on_update(u: Update, _post=self.mailbox.post, _q=self.queue):
                _post(_q, u)
            try:
                rid = engine.submit(choice.prompt_ids, sampling, on_update)
            except QueueFull as e:
                self.cancel()
                retry = self.state.retry_after_s if not math.isfinite(e.retry_after) else max(1, math.ceil(
                    e.retry_after))
                raise APIError(429 if math.isfinite(e.retry_after) else 503, str(e), type="rate_limit_exceeded"
                               if math.isfinite(e.retry_after) else "server_error", code="queue_full",
                               headers={"Retry-After": str(retry)}) from None
            except RequestRefused as e:
                self.cancel()
                raise APIError(400, str(e), param=e.param, code="invalid_value") from None
            choice.request_id = rid
            self.by_rid[rid] = choice

    def cancel(self) -> None:
        """Cancel every choice still running (their memory is freed at the engine's next step)."""
        for choice in self.choices:
            if choice.request_id is not None and not choice.done:
                self.state.engine.cancel(choice.request_id)

    async def pieces(self):
        """Yield ``[(choice, new text)]`` each time updates arrive, until every choice is done. Choices
        that ended on a stop string are cancelled in the engine here (memory freed at its next step)."""
        while not all(c.done for c in self.choices):
            updates = [await self.queue.get()]
            while not self.queue.empty():
                updates.append(self.queue.get_nowait())
            latest: dict[str, Update] = {}
            for u in updates:  # cumulative tokens: the last update of a request says everything
                if u.request_id in latest and latest[u.request_id].finished:
                    continue
                latest[u.request_id] = u
            out = []
            for rid, u in latest.items():
                choice = self.by_rid.get(rid)
                if choice is None or choice.done:
                    continue
                before = choice.seen
                text = choice.take(u)
                self.state.metrics.delivered(choice.seen - before)
                if choice.done and not u.finished:
                    self.state.engine.cancel(rid)  # a stop string (or an EOS) ended it: the engine would go on
                if text and self.first_text_at is None:
                    self.first_text_at = time.monotonic()
                    self.state.metrics.ttft.observe(self.first_text_at - self.start)
                out.append((choice, text))
            if out:
                yield out
        self.state.metrics.duration.observe(time.monotonic() - self.start)

    def usage(self, prompt_tokens: int) -> dict:
        completion = sum(c.seen for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def failed(self) -> Optional[str]:
        return next((c.error for c in self.choices if c.error), None)


def _check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or token.strip() != state.api_key:
        raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")


def _check_ready(state: ServerState) -> None:
    if state.shutting_down:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if not state.ready:
        detail = f": {state.load_error}" if state.load_error else "; retry when GET /health answers 200"
        raise APIError(503, f"the model is not loaded yet{detail}", type="server_error", code="not_ready",
                       headers={"Retry-After": str(state.retry_after_s)})


async def _parse(request: Request, schema):
    body = await request.body()
    try:
        parsed = schema.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    parsed.check_common()
    return parsed


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _limits(state: ServerState, prompt_ids: list[int], max_tokens: Optional[int], prompt_param: str,
            limit_param: str = "max_tokens") -> int:
    """``max_new_tokens`` for a prompt: ``max_tokens``, or (None) as many as ``max_seq_len`` leaves; 400
    when the prompt is empty, holds an id outside the vocabulary, or it and ``max_tokens`` exceed
    ``max_seq_len`` (that error names ``limit_param``, the field the client sent: ``max_tokens`` or
    ``max_completion_tokens``)."""
    n, limit = len(prompt_ids), state.max_seq_len
    if n == 0:
        raise APIError(400, f"{prompt_param}: the prompt is empty (0 tokens)", param=prompt_param,
                       code="invalid_value")
    bad = next((t for t in prompt_ids if not 0 <= t < state.codec.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{prompt_param}: token id {bad} is outside the vocabulary [0, "
                       f"{state.codec.vocab_size})", param=prompt_param, code="invalid_value")
    if n >= limit:
        raise APIError(400, f"{prompt_param}: the prompt is {n} tokens; this server's max_seq_len is {limit} "
                       f"tokens, which must hold the prompt and at least one new token", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        return limit - n
    if n + max_tokens > limit:
        raise APIError(400, f"{limit_param}: the prompt ({n} tokens) + {limit_param} ({max_tokens}) = "
                       f"{n + max_tokens} tokens exceeds this server's max_seq_len of {limit} tokens; "
                       f"{limit_param} may be at most {limit - n}", param=limit_param,
                       code="context_length_exceeded")
    return max_tokens


def _sampling(body, max_new: int, j: int) -> Sampling:
    # choice j of n draws from seed + j, so n sampled choices differ and the response is reproducible
    seed = None if body.seed is None else body.seed + j
    return Sampling(max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p, seed=seed,
                    min_new_tokens=body.min_tokens)


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [state.codec.encode(p)]
    if not p:
        raise APIError(400, "prompt: the prompt is empty (an empty list)", param="prompt", code="invalid_value")
    if isinstance(p[0], int):
        return [list(p)]
    return [state.codec.encode(x) if isinstance(x, str) else list(x) for x in p]


async def _watch_disconnect(request: Request) -> None:
    # the body has been read, so the next message is the client going away
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _run(state: ServerState, request: Request, prompts: list[list[int]], body, chat: bool) -> Response:
    max_new = [_limits(state, p, body.limit,
                       "messages" if chat else ("prompt" if len(prompts) == 1 else f"prompt.{i}"), body.limit_param)
               for i, p in enumerate(prompts)]
    choices, sampling = [], []
    for i, p in enumerate(prompts):
        for j in range(body.n):
            choices.append(_Choice(len(choices), state.codec, p, body.stop_list, max_new[i], body.min_tokens))
            sampling.append(_sampling(body, max_new[i], j))
    gen = _Generation(state, choices, sampling)
    gen.submit()
    state.metrics.prompt_tokens.inc(sum(map(len, prompts)))
    prompt_tokens = sum(map(len, prompts))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        return EventSourceResponse(_stream(state, gen, rid, created, body, chat, prompt_tokens), ping=15,
                                   send_timeout=30, sep="\n")
    waiter = asyncio.ensure_future(_collect(gen))
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not waiter.done():
            waiter.cancel()
            gen.cancel()
    if not waiter.done() or waiter.cancelled():
        return Response(status_code=499)  # the client is gone: nobody reads this
    waiter.result()
    error = gen.failed()
    if error:
        raise APIError(500, f"generation failed: {error}", type="server_error", code="engine_error")
    if chat:
        out = [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text_parts)},
                "logprobs": None, "finish_reason": c.finish_reason} for c in choices]
    else:
        out = [{"index": c.index, "text": "".join(c.text_parts), "logprobs": None,
                "finish_reason": c.finish_reason} for c in choices]
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": state.model_name, "choices": out,
                         "usage": gen.usage(prompt_tokens)})


async def _collect(gen: _Generation) -> None:
    async for _ in gen.pieces():
        pass


async def _stream(state: ServerState, gen: _Generation, rid: str, created: int, body, chat: bool,
                  prompt_tokens: int):
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_key = {"usage": None} if body.include_usage else {}

    def chunk(choices):
        return json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_name,
                           "choices": choices, **usage_key})

    def choice_obj(c: _Choice, text: Optional[str], first: bool = False):
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": text or "", "logprobs": None, "finish_reason": c.finish_reason}

    finished = False
    try:
        if chat:  # OpenAI's first chunk of each choice carries the role
            yield {"data": chunk([dict(choice_obj(c, None, first=True), finish_reason=None) for c in gen.choices])}
        async for pieces in gen.pieces():
            error = gen.failed()
            if error:
                yield {"data": json.dumps(APIError(500, f"generation failed: {error}", type="server_error",
                                                   code="engine_error").body())}
                break
            shown = [choice_obj(c, text) for c, text in pieces if text or c.done]
            if shown:
                yield {"data": chunk(shown)}
        if body.include_usage:
            yield {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                       "choices": [], "usage": gen.usage(prompt_tokens)})}
        yield {"data": "[DONE]"}
        finished = True
    finally:
        if not finished:  # the client went away (the generator was closed) or the server is stopping
            gen.cancel()


class _ShutdownCut:
    """ASGI middleware: a request the server cancels (uvicorn cancels what outlives ``--shutdown-timeout``;
    nothing else cancels a request's task) ends with one log line and a well-formed end of its response,
    not with uvicorn's "Exception in ASGI application" traceback of the ``CancelledError``. The client
    gets a 503 ``shutting_down`` body when nothing was sent yet, or, mid-stream, that error as a last SSE
    event (the openai client raises it) before the stream is closed; its engine requests are cancelled by
    the stream's own cleanup."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = {"started": False, "complete": False, "sse": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                sent["started"] = True
                sent["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                  for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the cancellation is handled here: the task ends normally
            log.warning("%s %s: cancelled by the server's shutdown (--shutdown-timeout ran out)",
                        scope.get("method"), scope.get("path"))
            error = APIError(503, "the server shut down before this request finished (its --shutdown-timeout ran "
                             "out)", type="server_error", code="shutting_down")
            if not sent["started"]:
                await JSONResponse(error.body(), status_code=503)(scope, receive, send)
            elif not sent["complete"]:
                tail = f"data: {json.dumps(error.body())}\n\n".encode() if sent["sse"] else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})


def create_app(state: ServerState, lifespan=None) -> Starlette:
    """The Starlette app over ``state``; ``lifespan``: an async context manager factory run around the
    server (loading the model, stopping the engine)."""
    if state.metrics is None:
        state.metrics = ServerMetrics(state)
    metrics = state.metrics

    def endpoint(path: str, handler, *, auth: bool):
        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    _check_auth(state, request)
                response = await handler(request)
            except APIError as e:
                response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            except Exception as e:  # noqa: BLE001 - a failure no check foresaw: OpenAI's body, not plain text
                log.exception("%s %s failed", request.method, path)
                error = APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error",
                                 code="internal_error")
                response = JSONResponse(error.body(), status_code=500)
            metrics.http_requests.labels(path, str(response.status_code)).inc()
            return response
        return wrapped

    async def completions(request: Request) -> Response:
        _check_ready(state)
        body = await _parse(request, CompletionRequest)
        _check_model(state, body.model)
        return await _run(state, request, _completion_prompts(state, body), body, chat=False)

    async def chat_completions(request: Request) -> Response:
        _check_ready(state)
        body = await _parse(request, ChatCompletionRequest)
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = state.codec.chat_ids(messages)
        except ChatTemplateMissing as e:
            raise APIError(400, str(e), param="messages", code="no_chat_template") from None
        except ChatTemplateRefused as e:
            raise APIError(400, f"messages: this model's chat template refuses them: {e}", param="messages",
                           code="invalid_value") from None
        return await _run(state, request, [prompt], body, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "unimem-compile",
             "max_model_len": state.max_seq_len}]})

    async def health(request: Request) -> Response:
        if state.ready and not state.shutting_down:
            return JSONResponse({"status": "ok"})
        status = "shutting_down" if state.shutting_down else ("failed" if state.load_error else "loading")
        return JSONResponse({"status": status, **({"error": state.load_error} if state.load_error else {})},
                            status_code=503)

    async def metrics_endpoint(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/completions", endpoint("/v1/completions", completions, auth=True), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("/v1/chat/completions", chat_completions, auth=True),
              methods=["POST"]),
        Route("/v1/models", endpoint("/v1/models", models, auth=True), methods=["GET"]),
        Route("/health", endpoint("/health", health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("/metrics", metrics_endpoint, auth=False), methods=["GET"]),
    ]
    async def http_error(request: Request, exc) -> Response:  # unknown path or method, in OpenAI's shape
        body = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").body()
        metrics.http_requests.labels("other", str(exc.status_code)).inc()
        return JSONResponse(body, status_code=exc.status_code)

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: http_error, 405: http_error},
                     middleware=[Middleware(_ShutdownCut)])
