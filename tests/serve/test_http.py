"""The HTTP layer against a scripted engine (fake_engine.py), over a live server on 127.0.0.1: the error
bodies of docs/serve.md, authentication, refusals, SSE framing, stop strings, choices, disconnects. The
same behaviour against the real engine: test_openai_live.py."""

import json
import logging
import time

import httpx2 as httpx
import openai
import pytest

from unimem_compile.serve import ServerState, ServerThread
from unimem_compile.serve.text import ByteCodec

from .fake_engine import FakeEngine

REPLY = "Hé, wörld ✓ STOP here 😀 end"
KEY = "sk-test-7f3a"


def _server(engine, **state):
    st = ServerState(model_name="fake", codec=ByteCodec(1024), max_seq_len=engine.max_seq_len, engine=engine,
                     ready=True, **state)
    return st, ServerThread(st).start()


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(REPLY, max_seq_len=64, max_queue=8)
    state, server = _server(engine, api_key=KEY)
    yield engine, state, server
    server.stop()
    engine.close()


def _post(server, path, body, key=KEY, raw=None):
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body), headers=headers,
                      timeout=30)


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_completion_and_chat_return_the_reply_and_usage(live):
    engine, _, server = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    r = client.completions.create(model="fake", prompt="hi ✓", max_tokens=50)
    assert r.choices[0].text == REPLY and r.choices[0].finish_reason == "stop"
    n_reply = len(REPLY.encode()) + 1  # + the EOS token
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (1 + len("hi ✓".encode()), n_reply)
    c = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert c.choices[0].message.content == REPLY.encode()[:5].decode() and c.choices[0].finish_reason == "length"
    prompt_ids, sampling = engine.submitted[-1]
    assert prompt_ids == ByteCodec(1024).chat_ids([{"role": "user", "content": "hi"}])
    assert sampling.max_new_tokens == 5 and sampling.temperature is None


def test_streamed_text_equals_the_non_streamed_text_and_chunks_are_openai_shaped(live):
    _, _, server = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    for stop in (None, "STOP", ["wör", "😀"]):
        whole = client.completions.create(model="fake", prompt="x", max_tokens=50, stop=stop)
        chunks = list(client.completions.create(model="fake", prompt="x", max_tokens=50, stop=stop, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        text = "".join(c.choices[0].text for c in chunks[:-1])
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
        # a multi-byte character is never split between events
        assert all("\ufffd" not in c.choices[0].text for c in chunks[:-1])
    assert whole.choices[0].text == "Hé, "  # "wör" comes before "😀"
    chat = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                               stop="STOP", stream=True))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chat) == REPLY[:REPLY.index("STOP")]
    assert chat[-1].choices[0].finish_reason == "stop"


def test_min_tokens_keeps_stop_strings_from_ending_a_shorter_reply(live):
    # REPLY's "STOP" is bytes 17-20 (one token per byte): token 20 completes it; vLLM's rule, no stop string
    # ends a reply before min_tokens tokens, but one that token min_tokens or later completes does
    _, _, server = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    assert len(REPLY.encode()[:REPLY.encode().index(b"STOP") + 4]) == 20
    for min_tokens, stop, text, tokens in ((20, ["STOP"], "Hé, wörld ✓ ", 20),
                                           (21, ["STOP"], REPLY, len(REPLY.encode()) + 1),
                                           (21, ["STOP", "e"], "Hé, wörld ✓ STOP h", 23)):
        whole = client.completions.create(model="fake", prompt="x", max_tokens=50, stop=stop,
                                          extra_body={"min_tokens": min_tokens})
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text, "stop"), min_tokens
        assert whole.usage.completion_tokens == tokens
        chunks = list(client.completions.create(model="fake", prompt="x", max_tokens=50, stop=stop, stream=True,
                                                extra_body={"min_tokens": min_tokens}))
        assert "".join(c.choices[0].text for c in chunks) == text


def test_n_choices_and_a_prompt_list_get_one_engine_request_each(live):
    engine, _, server = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    before = len(engine.submitted)
    r = client.completions.create(model="fake", prompt=["a", "bc"], n=3, max_tokens=4, seed=11, temperature=0.7,
                                  extra_body={"min_tokens": 2})
    assert [c.index for c in r.choices] == list(range(6)) and {c.text for c in r.choices} == {REPLY[:3]}
    subs = engine.submitted[before:]
    assert [len(p) for p, _ in subs] == [2, 2, 2, 3, 3, 3]
    assert [s.seed for _, s in subs] == [11, 12, 13] * 2 and {s.temperature for _, s in subs} == {0.7}
    assert {(s.max_new_tokens, s.min_new_tokens) for _, s in subs} == {(4, 2)}
    assert r.usage.prompt_tokens == 5


@pytest.mark.parametrize("body, param, words", [
    (None, None, ["not valid JSON"]),
    ({"model": "fake", "prompt": "x", "max_tokens": "5"}, "max_tokens", ["valid integer", "'5'"]),
    ({"model": "fake", "prompt": "x", "temperature": 2.5}, "temperature", ["less than or equal to 2", "2.5"]),
    ({"model": "fake", "prompt": "x", "bogus": 1}, "bogus", ["unrecognized request argument"]),
    ({"model": "fake", "prompt": "x", "stream": 1}, "stream", ["valid boolean"]),
    ({"model": "fake", "prompt": "x", "max_tokens": 63}, "max_tokens", ["(2 tokens)", "(63)", "65", "64", "at most 62"]),
    ({"model": "fake", "prompt": "y" * 70}, "prompt", ["71 tokens", "max_seq_len is 64"]),
    ({"model": "fake", "prompt": []}, "prompt", ["empty"]),
    ({"model": "fake", "prompt": [5, 4000]}, "prompt", ["token id 4000", "[0, 1024)"]),
    ({"model": "fake", "prompt": "x", "n": 17}, "n", ["less than or equal to 16"]),
    ({"model": "fake", "prompt": "x", "logprobs": 2}, "logprobs", ["not supported"]),
    ({"model": "fake", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", ["at most 4", "5"]),
    ({"model": "fake", "prompt": "x", "stop": ""}, "stop", ["an empty stop string;"]),
    ({"model": "fake", "prompt": "x", "stop": ["ab", ""]}, "stop", ["an empty stop string (stop.1)"]),
    ({"model": "fake", "prompt": [[5, 6], []]}, "prompt.1", ["empty (0 tokens)"]),
    ({"model": "fake", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
    ({"prompt": "x"}, "model", ["required"]),
    ({"model": "fake", "prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens", ["4", "(3)"]),
    # a mixed prompt list: pydantic's union message was "Input should be a valid string; or ... integer; or ..."
    ({"model": "fake", "prompt": ["a", [5, 6]]}, "prompt", [
        "prompt: a prompt is a string, a list of strings, a list of token ids or a list of token-id lists, not a "
        "mix: item 0 is a string and item 1 a token-id list (got ['a', [5, 6]])"]),
    ({"model": "fake", "prompt": [[5], [6], 7, "z"]}, "prompt", ["not a mix: item 0 is a token-id list and item 2 a "
                                                                 "token id"]),
    ({"model": "fake", "prompt": "x", "logit_bias": {"50": 0, "7": 1.5}}, "logit_bias", [
        "not supported by this server (got {'50': 0.0, '7': 1.5}; only an empty map or a bias of 0 for every "
        "token is accepted)"]),
    ({"model": "fake", "prompt": "x", "logit_bias": {"-3": 0}}, "logit_bias", ["the key '-3' is not a token id"]),
    # the server takes no per-request EOS ids (the model's generation config gives them)
    ({"model": "fake", "prompt": "x", "eos_token_id": [5]}, "eos_token_id", ["unrecognized request argument"]),
])
def test_bad_completion_bodies_get_400_naming_the_field_and_numbers(live, body, param, words):
    engine, _, server = live
    before = len(engine.submitted)
    err = _error(_post(server, "/v1/completions", body, raw="{'model': 1" if body is None else None), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    for w in words:
        assert w in err["message"], err["message"]
    assert len(engine.submitted) == before  # nothing reached the engine


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_logit_bias_of_zeros_is_a_no_op_and_accepted(live, path, body):
    """A bias of 0 for every token changes nothing, so it is accepted like an empty map (it used to be refused
    as unsupported); the request reaches the engine exactly as without it."""
    engine, _, server = live
    plain = _post(server, path, {"model": "fake", "max_tokens": 6, **body})
    zeros = _post(server, path, {"model": "fake", "max_tokens": 6, "logit_bias": {"50": 0, "1023": -0.0}, **body})
    assert plain.status_code == zeros.status_code == 200, zeros.text
    assert [c.get("text", c.get("message")) for c in plain.json()["choices"]] == \
        [c.get("text", c.get("message")) for c in zeros.json()["choices"]]
    assert engine.submitted[-1] == engine.submitted[-2]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw, kind", [(b"[]", "array"), (b'"x"', "string"), (b"3", "number"), (b"null", "null"),
                                       (b"true", "boolean")])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(live, path, raw, kind):
    engine, _, server = live
    before = len(engine.submitted)
    err = _error(_post(server, path, None, raw=raw), 400)
    assert err == {"message": f"the request body must be a JSON object, got {kind}", "type": "invalid_request_error",
                   "param": None, "code": "invalid_value"}
    assert len(engine.submitted) == before


def test_an_empty_prompt_string_is_its_bos_token_and_one_of_no_tokens_is_a_400(live):
    engine, state, server = live
    r = _post(server, "/v1/completions", {"model": "fake", "prompt": "", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1 and engine.submitted[-1][0] == [ByteCodec.bos_token_id]
    before = len(engine.submitted)

    class NoBos(ByteCodec):  # a tokenizer that adds no special token: "" is no token at all
        def encode(self, text):
            return super().encode(text)[1:]

    codec, state.codec = state.codec, NoBos(1024)
    try:
        for body, param in (({"model": "fake", "prompt": ""}, "prompt"), ({"model": "fake", "prompt": ["a", ""]},
                                                                            "prompt.1")):
            err = _error(_post(server, "/v1/completions", body), 400)
            assert err["param"] == param and "the prompt is empty (0 tokens)" in err["message"]
    finally:
        state.codec = codec
    assert len(engine.submitted) == before


def test_a_stop_string_ends_its_choice_at_the_token_that_completed_it():
    # eight tokens per update, as a decode block: "STOP" is completed by reply token 20, inside the third update
    engine = FakeEngine(REPLY * 8, max_seq_len=512, step_s=0.02, block=8)
    _, server = _server(engine)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        upto = len(REPLY[:REPLY.index("STOP") + 4].encode())
        assert upto == 20
        delivered = 0
        for stop, n_tokens in (("STOP", upto), (["zz", "😀"], len(REPLY[:REPLY.index("😀") + 1].encode()))):
            whole = client.completions.create(model="fake", prompt="x", max_tokens=400, stop=stop, n=2)
            chunks = list(client.completions.create(model="fake", prompt="x", max_tokens=400, stop=stop, stream=True,
                                                    stream_options={"include_usage": True}))
            chat = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                                  max_tokens=400, stop=stop)
            want = REPLY[:REPLY.index(stop if isinstance(stop, str) else "😀")]
            assert [c.text for c in whole.choices] == [want] * 2 and chat.choices[0].message.content == want
            assert {c.finish_reason for c in whole.choices + chat.choices} == {"stop"}
            assert "".join(c.choices[0].text for c in chunks[:-1]) == want
            assert chunks[-2].choices[0].finish_reason == "stop"
            assert (whole.usage.completion_tokens, chunks[-1].usage.completion_tokens,
                    chat.usage.completion_tokens) == (2 * n_tokens, n_tokens, n_tokens)
            delivered += 4 * n_tokens
        # every request was cancelled where its stop string matched, long before max_tokens
        rids = list(engine.generated)
        assert len(rids) == 8 and sorted(engine.cancelled) == sorted(rids) and engine.finished == []
        assert max(len(engine.generated[r]) for r in rids) < 100
        text = httpx.get(server.url + "/metrics").text
        assert f"unimem_generation_tokens_total {float(delivered)}\n" in text
    finally:
        server.stop()
        engine.close()


def test_bad_chat_bodies_and_unknown_model(live):
    _, _, server = live
    err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": [{"role": "robot",
                                                                                       "content": "x"}]}), 400)
    assert err["param"] == "messages.0.role" and "'robot'" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": []}), 400)
    assert err["param"] == "messages" and "at least 1 item" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}), 400)
    assert err["param"] == "max_completion_tokens" and "(3)" in err["message"] and "(4)" in err["message"]
    for field in ("max_tokens", "max_completion_tokens"):  # the limit error names the field the client sent
        err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": [
            {"role": "user", "content": "x"}], field: 64}), 400)
        assert err["param"] == field and err["code"] == "context_length_exceeded", err
        assert f"{field} (64)" in err["message"] and "max_seq_len of 64 tokens" in err["message"], err
    err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "user", "content": "x"}], "stop": [""]}), 400)
    assert err["param"] == "stop" and "empty stop string" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "user", "content": "x"}], "tools": [{"type": "function"}]}), 400)
    assert err["param"] == "tools" and err["code"] == "unsupported_parameter"
    err = _error(_post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)
    assert err["param"] == "model" and "'fake'" in err["message"]


def test_messages_a_chat_template_refuses_are_a_400_with_its_message():
    """Templates raise for messages they do not take (Llama 2 / Mistral / Gemma style: no system role, roles
    that must alternate); that was a plain-text 500 with a traceback in the log."""
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                "supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    engine = FakeEngine(REPLY, max_seq_len=64)
    st = ServerState(model_name="fake", codec=ByteCodec(1024, chat_template=template), max_seq_len=64,
                     engine=engine, ready=True)
    server = ServerThread(st).start()
    try:
        err = _error(_post(server, "/v1/chat/completions", {"model": "fake", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}, key=None), 400)
        assert err == {"message": "messages: this model's chat template refuses them: System role not supported",
                       "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}
        assert engine.submitted == []
        ok = _post(server, "/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
                   key=None)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == REPLY
    finally:
        server.stop()
        engine.close()


def test_an_unforeseen_failure_is_a_500_in_openais_shape_and_counted(caplog):
    class Broken(ByteCodec):
        def encode(self, text):
            raise RuntimeError("tokenizer exploded")

    engine = FakeEngine(REPLY, max_seq_len=64)
    st = ServerState(model_name="fake", codec=Broken(1024), max_seq_len=64, engine=engine, ready=True)
    server = ServerThread(st).start()
    try:
        with caplog.at_level(logging.ERROR, logger="unimem_compile.serve"):
            err = _error(_post(server, "/v1/completions", {"model": "fake", "prompt": "hi"}, key=None), 500)
        assert err == {"message": "internal server error: RuntimeError: tokenizer exploded", "type": "server_error",
                       "param": None, "code": "internal_error"}
        assert "POST /v1/completions failed" in caplog.text and "tokenizer exploded" in caplog.text
        metrics = httpx.get(server.url + "/metrics").text
        assert 'unimem_http_requests_total{endpoint="/v1/completions",status="500"} 1.0' in metrics
        assert engine.submitted == []
    finally:
        server.stop()
        engine.close()


def test_api_key_is_required_and_refused_requests_never_reach_the_engine(live):
    engine, _, server = live
    before = len(engine.submitted)
    for key in (None, "wrong"):
        err = _error(_post(server, "/v1/completions", {"model": "fake", "prompt": "x"}, key=key), 401)
        assert err["type"] == "authentication_error"
        _error(httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {key}"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").completions.create(model="fake", prompt="x")
    assert len(engine.submitted) == before
    models = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["fake"] and models["data"][0]["max_model_len"] == 64
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_more_completions_than_the_queue_holds_is_a_400_not_a_429_forever():
    engine = FakeEngine(REPLY, max_seq_len=64, max_queue=2)
    _, server = _server(engine)
    try:
        for body in ({"model": "fake", "prompt": "x", "n": 3}, {"model": "fake", "prompt": ["a", "b", "c"]}):
            err = _error(_post(server, "/v1/completions", body, key=None), 400)
            assert err["param"] == "n" and "asks for 3 completions" in err["message"] and "queues at a time" in \
                err["message"] and "2 requests" in err["message"]
        assert engine.submitted == []  # nothing was queued
        assert _post(server, "/v1/completions", {"model": "fake", "prompt": "x", "n": 2}, key=None).status_code == 200
    finally:
        server.stop()
        engine.close()


def test_a_full_engine_answers_429_with_retry_after():
    engine = FakeEngine(REPLY * 4, max_seq_len=512, max_queue=2, step_s=0.05)
    _, server = _server(engine)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        streams = [client.completions.create(model="fake", prompt="x", max_tokens=100, stream=True) for _ in range(2)]
        resp = _post(server, "/v1/completions", {"model": "fake", "prompt": "x", "n": 1}, key=None)
        err = _error(resp, 429)
        assert resp.headers["retry-after"] == "1" and err["code"] == "queue_full"
        for s in streams:
            s.close()
        deadline = time.monotonic() + 5
        while engine.live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.live
    finally:
        server.stop()
        engine.close()


def test_a_closed_stream_cancels_its_engine_request():
    engine = FakeEngine(REPLY * 8, max_seq_len=512, step_s=0.02)
    _, server = _server(engine)
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"model": "fake", "prompt": "x", "max_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        deadline = time.monotonic() + 5
        while not engine.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.cancelled) == 1 and not engine.live
    finally:
        server.stop()
        engine.close()


def test_a_failed_request_is_a_500_and_a_stream_error_event():
    engine = FakeEngine(REPLY, fail_after=3)
    _, server = _server(engine)
    try:
        err = _error(_post(server, "/v1/completions", {"model": "fake", "prompt": "x"}, key=None), 500)
        assert "scripted failure" in err["message"] and err["type"] == "server_error"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="scripted failure"):
            list(client.completions.create(model="fake", prompt="x", stream=True))
    finally:
        server.stop()
        engine.close()


def test_health_is_503_until_ready_and_metrics_name_the_engine_figures():
    engine = FakeEngine(REPLY)
    state, server = _server(engine)
    try:
        state.ready = False
        assert httpx.get(server.url + "/health").json() == {"status": "loading"}
        resp = _post(server, "/v1/completions", {"model": "fake", "prompt": "x"}, key=None)
        assert _error(resp, 503)["code"] == "not_ready" and resp.headers["retry-after"] == "1"
        state.ready = True
        assert httpx.get(server.url + "/health").status_code == 200
        _post(server, "/v1/completions", {"model": "fake", "prompt": "x", "max_tokens": 7}, key=None)
        assert 'endpoint="/metrics"' not in httpx.get(server.url + "/metrics").text  # counted once answered
        text = httpx.get(server.url + "/metrics").text
        for line in ('unimem_requests_running 0.0', 'unimem_arena_bytes{side="kv"} 0.0',
                     'unimem_arena_bytes{side="free"} 4000.0', 'unimem_arena_bytes{side="reserved"} 96.0',
                     'unimem_arena_capacity_bytes 4096.0', 'unimem_preemptions_total 3.0',
                     'unimem_http_requests_total{endpoint="/metrics",status="200"} 1.0',
                     'unimem_engine_tokens_per_second 1.5', 'unimem_server_ready 1.0',
                     'unimem_generation_tokens_total 7.0', 'unimem_prompt_tokens_total 2.0',
                     'unimem_http_requests_total{endpoint="/v1/completions",status="503"} 1.0',
                     'unimem_http_requests_total{endpoint="/v1/completions",status="200"} 1.0'):
            assert line in text, line
        state.shutting_down = True
        assert httpx.get(server.url + "/health").json() == {"status": "shutting_down"}
    finally:
        server.stop()
        engine.close()


def test_shutdown_cuts_a_live_stream_with_one_log_line_and_no_traceback():
    engine = FakeEngine(REPLY * 40, max_seq_len=2048, step_s=0.02)
    state = ServerState(model_name="fake", codec=ByteCodec(1024), max_seq_len=2048, engine=engine, ready=True)
    server = ServerThread(state, shutdown_timeout=0.3)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    # after the server's construction: uvicorn's logging config replaces the handlers of its loggers
    loggers = [logging.getLogger(name) for name in ("uvicorn", "unimem_compile.serve")]
    keep = Keep(logging.INFO)
    for lg in loggers:
        lg.addHandler(keep)
    try:
        server.start()
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"model": "fake", "prompt": "x", "max_tokens": 1500, "stream": True}) as r:
            it = r.iter_lines()
            lines.append(next(line for line in it if line.startswith("data: {")))
            server.stop()
            assert not server.thread.is_alive()  # the server exited well before the reply's 1500 tokens
            lines += [line for line in it if line.startswith("data: ")]
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
        engine.close()
    last = json.loads(lines[-1][len("data: "):])
    assert last["error"]["code"] == "shutting_down" and "--shutdown-timeout" in last["error"]["message"]
    assert "data: [DONE]" not in lines
    assert engine.cancelled == ["fake-1"] and not engine.live
    assert [r for r in records if r.exc_info or "Traceback" in r.getMessage()] == []
    cut = [r.getMessage() for r in records if r.name == "unimem_compile.serve"]
    assert cut == ["POST /v1/completions: cancelled by the server's shutdown (--shutdown-timeout ran out)"]


def test_mailbox_wakes_the_loop_once_per_batch_and_loses_no_update():
    """Updates posted from another thread while the loop is busy reach their queues in order, with one
    call_soon_threadsafe per batch (a step of R requests: one wake-up of the loop, not R)."""
    import asyncio
    import threading

    from unimem_compile.serve.app import _Mailbox
    from unimem_compile.serve.engine import Update

    async def main():
        loop = asyncio.get_running_loop()
        box = _Mailbox(loop)
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a: (cb == box._drain and wakeups.append(cb), real(cb, *a))[1]
        queues = [asyncio.Queue() for _ in range(5)]

        def step(k):  # one engine step: every request gets an update
            for i, q in enumerate(queues):
                box.post(q, Update(f"r{i}", list(range(k + 1))))

        t = threading.Thread(target=lambda: [step(k) for k in range(3)])
        t.start()
        t.join()  # three steps posted while the loop is blocked here, so it cannot drain between them
        assert len(wakeups) == 1
        await asyncio.sleep(0)
        got = [[q.get_nowait().generated_tokens for _ in range(q.qsize())] for q in queues]
        assert got == [[[0], [0, 1], [0, 1, 2]]] * 5
        # a post racing the drain: 200 posts from a thread while the loop drains, none lost
        t = threading.Thread(target=lambda: [box.post(queues[0], Update("r0", [j])) for j in range(200)])
        t.start()
        seen = []
        while len(seen) < 200:
            seen.append((await asyncio.wait_for(queues[0].get(), 5)).generated_tokens[0])
        t.join()
        assert seen == list(range(200)) and 2 <= len(wakeups) <= 201

    asyncio.run(main())


def test_manager_engine_hands_over_a_steps_results_together_and_survives_a_raising_callback(caplog):
    """ManagerEngine's dispatcher takes every result waiting at once; a callback that raises is logged and
    the other requests still get their updates (the dispatcher thread does not die)."""
    import collections
    import threading

    from unimem_compile.serve.engine import ManagerEngine, Sampling

    class Out:
        def __init__(self, rid, toks, status):
            self.request_id, self.generated_tokens, self.status, self.error = rid, toks, status, None

    class FakeManager:  # the manager's API as ManagerEngine uses it, results published by the test
        max_queue = None

        def __init__(self):
            self.outbox, self.cond, self.ids = collections.deque(), threading.Condition(), []

        def is_running(self):
            return True

        def add_request(self, ids, request_id, **kw):
            self.ids.append(request_id)

        def cancel_request(self, rid):
            pass

        def stop(self, **kw):
            pass

        def get_result(self, timeout=None):
            with self.cond:
                if not self.outbox and timeout:
                    self.cond.wait(timeout)
                return self.outbox.popleft() if self.outbox else None

    mgr = FakeManager()
    eng = ManagerEngine(mgr, 64, poll_s=0.01)
    got, done = collections.defaultdict(list), threading.Event()

    def make(i):
        def cb(u):
            got[i].append((u.generated_tokens, u.status))
            if i == 1:
                raise RuntimeError("a broken callback")
            if i == 2 and u.finished:
                done.set()
        return cb

    rids = [eng.submit([5, 6], Sampling(max_new_tokens=4), make(i)) for i in range(3)]
    with caplog.at_level(logging.ERROR, "unimem_compile.serve"):
        with mgr.cond:
            for k in range(1, 4):  # three steps' results waiting together
                for rid in rids:
                    mgr.outbox.append(Out(rid, list(range(k)), "DECODING" if k < 3 else "FINISHED"))
            mgr.cond.notify_all()
        assert done.wait(5)
    eng.close(timeout=5)
    want = [([0], "running"), ([0, 1], "running"), ([0, 1, 2], "finished")]
    assert got[0] == want and got[1] == want and got[2] == want
    assert eng.outstanding() == 0
    assert sum("the update callback of" in r.getMessage() for r in caplog.records) == 3
