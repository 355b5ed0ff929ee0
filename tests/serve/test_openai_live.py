"""The server against the REAL engine: the tiny Kimi-Linear model compiled in fp32 with
``backend="aot_eager"``, its continuous-batching manager, a live server on 127.0.0.1 and a free port,
driven by the official ``openai`` client. One compiled model and one server for the module; the reference
is the same model's greedy ``generate()``. The last test runs the CLI itself (``unimem-compile serve`` in
a subprocess: loading, /health, SIGTERM)."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest
import torch

import unimem_compile
from unimem_compile.hf.models import build_model
from unimem_compile.serve import ManagerEngine, ServerState, ServerThread
from unimem_compile.serve.server import free_port, warm_up
from unimem_compile.serve.text import ByteCodec

MODEL = "kimi-linear-tiny"
KEY = "sk-live-93c1"
MAX_SEQ = 96
MAX_BATCH = 4
MAX_QUEUE = 12
PROMPTS = ["The capital of France is", "Once upon a time, ✓", "def add(a, b):"]
CODEC = ByteCodec(1024)


@pytest.fixture(scope="module")
def model():
    m = build_model(MODEL)
    unimem_compile.compile(m, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, page_size=16, backend="aot_eager")
    return m


@pytest.fixture(scope="module")
def server(model):
    engine = ManagerEngine(model.init_continuous_batching(max_queue=MAX_QUEUE), MAX_SEQ)
    warm_up(engine, CODEC)
    state = ServerState(model_name=MODEL, codec=CODEC, max_seq_len=MAX_SEQ, api_key=KEY, engine=engine, ready=True)
    thread = ServerThread(state).start()
    yield thread.url
    thread.stop()
    engine.close()


def _reference_ids(model, prompt_ids, max_new):
    """The greedy reply tokens of ``generate()`` (EOS and what follows dropped)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    if CODEC.eos_token_id in new:
        new = new[:new.index(CODEC.eos_token_id)]
    return new


def _reference(model, prompt_ids, max_new):
    """The greedy reply text of ``generate()``."""
    return CODEC.decode(_reference_ids(model, prompt_ids, max_new))


def _metrics(url):
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    # every scrape: the arena's four sides are its capacity to the byte (float64 holds these sizes exactly)
    sides = sum(out[f'unimem_arena_bytes{{side="{side}"}}'] for side in ("kv", "state", "free", "reserved"))
    assert sides == out["unimem_arena_capacity_bytes"], (sides, out["unimem_arena_capacity_bytes"])
    return out


def _wait_idle(url, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        idle = (m["unimem_requests_running"], m["unimem_requests_waiting"], m['unimem_arena_bytes{side="kv"}'],
                m['unimem_arena_bytes{side="state"}'])
        if idle == (0, 0, 0, 0):
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: running, waiting, kv, state = {idle}"
        time.sleep(0.05)


def test_models_lists_the_served_model_and_metrics_the_arena(server, model):
    url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [MODEL]
    lay = model.unimem.pool.layout
    m = _metrics(url)
    assert m["unimem_arena_capacity_bytes"] == lay.memory_budget
    assert m['unimem_arena_bytes{side="reserved"}'] == lay.sink_floor + lay.memory_budget - lay.usable > 0


def test_streamed_equals_non_streamed_equals_generate(server, model):
    url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    for prompt in PROMPTS:
        want = _reference(model, CODEC.encode(prompt), 16)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        parts = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        assert whole.choices[0].text == want
        assert "".join(c.choices[0].text for c in parts) == want
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[1]}]
    want = _reference(model, CODEC.chat_ids(messages), 12)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    parts = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(parts)
    assert whole.choices[0].message.content == want
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(CODEC.chat_ids(messages))


def test_stop_string_trims_the_greedy_text(server, model):
    url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    text = _reference(model, CODEC.encode(PROMPTS[0]), 24)
    starts = [i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2]]
    assert starts, f"no clean two-character stop string in {text!r}"
    stop = text[starts[0]:starts[0] + 2]
    ids = _reference_ids(model, CODEC.encode(PROMPTS[0]), 24)
    # the reply's tokens: up to the one whose text completes the stop string (decodes end at a whole character)
    upto = next(k for k in range(1, len(ids) + 1) if stop in CODEC.decode(ids[:k]))
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                      stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(r) if stream else None
        got = "".join(c.choices[0].text for c in chunks[:-1]) if stream else r.choices[0].text
        assert got == text[:text.find(stop)]
        assert (chunks[-2] if stream else r).choices[0].finish_reason == "stop"
        assert (chunks[-1] if stream else r).usage.completion_tokens == upto
    _wait_idle(url)  # the request that hit its stop string was cancelled and freed


def test_seeded_sampling_is_reproducible_and_choices_differ(server):
    url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, n=2, temperature=0.9,
              top_p=0.95, seed=7)
    a = [c.message.content for c in client.chat.completions.create(**kw).choices]
    b = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert a == b and a[0] != a[1]


def test_bad_inputs_get_their_documented_bodies(server):
    url = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abc", max_tokens=MAX_SEQ)
    assert e.value.body["param"] == "max_tokens" and f"max_seq_len of {MAX_SEQ}" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="z" * MAX_SEQ, max_tokens=1)
    assert e.value.body["param"] == "prompt" and f"{MAX_SEQ + 1} tokens" in e.value.body["message"]
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_disconnect_mid_stream_cancels_and_frees_memory(server):
    url = server
    before = _metrics(url)
    with httpx.stream("POST", url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 80, "temperature": 0,
                            "stream": True}) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(line)
            if len(events) == 2:
                break
    after = _wait_idle(url)
    key = 'unimem_engine_requests_total{outcome="cancelled"}'
    assert after[key] == before[key] + 1


async def _load(url, n_requests, concurrency, references):
    """``n_requests`` greedy requests from ``concurrency`` async clients; a 429 is retried after a short
    pause (it must carry Retry-After). Returns (answers per request, 429 count)."""
    answers = {i: [] for i in range(n_requests)}
    refusals = 0
    queue = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(i):
        prompt, max_new = references[i % len(references)][:2]
        chat, stream = i % 3 == 0, i % 2 == 0
        if chat:
            kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_new, temperature=0)
            if stream:
                return "".join([c.choices[0].delta.content or "" async for c in
                                await client.chat.completions.create(stream=True, **kw)])
            return (await client.chat.completions.create(**kw)).choices[0].message.content
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_new, temperature=0)
        if stream:
            return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **kw)])
        return (await client.completions.create(**kw)).choices[0].text

    async def worker():
        nonlocal refusals
        while not queue.empty():
            i = queue.get_nowait()
            while True:
                try:
                    answers[i].append(await one(i))
                    break
                except openai.RateLimitError as e:
                    assert e.response.headers["retry-after"] == "1"
                    refusals += 1
                    await asyncio.sleep(0.2)

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout=240)
    await client.close()
    return answers, refusals


def test_load_every_request_answered_once_arena_empty_only_429s(server, model):
    url = server
    n, concurrency = 200, 2 * MAX_QUEUE
    references = []
    for k, prompt in enumerate(PROMPTS * 2):
        max_new = 2 + k % 4
        completion = _reference(model, CODEC.encode(prompt), max_new)
        chat = _reference(model, CODEC.chat_ids([{"role": "user", "content": prompt}]), max_new)
        references.append((prompt, max_new, completion, chat))
    before = _metrics(url)
    answers, refusals = asyncio.run(_load(url, n, concurrency, references))
    for i, got in answers.items():
        _, _, completion, chat = references[i % len(references)]
        assert got == [chat if i % 3 == 0 else completion], i
    after = _wait_idle(url)
    finished = 'unimem_engine_requests_total{outcome="finished"}'
    # the engine ran each request exactly once: no duplicate behind a retried 429
    assert after[finished] - before[finished] == n
    assert after['unimem_engine_requests_total{outcome="failed"}'] == before['unimem_engine_requests_total{outcome="failed"}']
    assert refusals > 0  # twice as many clients as the queue holds: the limit was exercised
    status_429 = 'unimem_http_requests_total{endpoint="/v1/completions",status="429"}'
    chat_429 = 'unimem_http_requests_total{endpoint="/v1/chat/completions",status="429"}'
    assert after.get(status_429, 0) + after.get(chat_429, 0) - before.get(status_429, 0) - before.get(chat_429, 0) \
        == refusals


def test_cli_serve_loads_answers_and_exits_0_on_sigterm_after_finishing_its_stream(model):
    port = free_port()
    cmd = [sys.executable, "-m", "unimem_compile.cli", "serve", "--model", MODEL, "--device", "cpu",
           "--backend", "aot_eager", "--max-batch-size", "2", "--max-seq-len", str(MAX_SEQ), "--page-size", "16",
           "--port", str(port), "--shutdown-timeout", "30", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = set()
        deadline = time.monotonic() + 300
        while "ok" not in statuses:
            assert proc.poll() is None, f"the server exited with {proc.returncode}: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the server did not become healthy within 300 s"
            try:
                statuses.add(httpx.get(url + "/health", timeout=2).json()["status"])
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert statuses == {"loading", "ok"}  # compiling takes seconds: the first polls saw it loading
        want = _reference(model, CODEC.encode(PROMPTS[0]), 20)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
                                "stream": True}) as r:
            events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            first = next(events)
            proc.send_signal(signal.SIGTERM)
            rest = list(events)
        assert rest[-1] == "[DONE]"  # the stream ran to its end during the graceful shutdown
        text = "".join(json.loads(e)["choices"][0]["text"] for e in [first] + rest[:-1])
        assert text == want
        assert proc.wait(60) == 0
        log = proc.stdout.read()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
