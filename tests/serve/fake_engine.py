"""A scripted engine for the HTTP layer's unit tests (the tests of record run the real engine:
test_openai_live.py). Each request "generates" the UTF-8 bytes of a reply chosen by the test, as
ByteCodec ids, ``block`` tokens per ``step_s`` on the engine's thread (one update per step, as the real
engine's decode blocks), then EOS if the reply is shorter than ``max_new_tokens``; so every byte the server
returns can be predicted exactly."""

from __future__ import annotations

import threading
import time

from unimem_compile.serve.engine import EngineMetrics, QueueFull, Sampling, Update
from unimem_compile.serve.text import ByteCodec


class FakeEngine:
    def __init__(self, reply: str | bytes = "Hello, world!", *, max_seq_len: int = 256, max_queue: int = 64,
                 step_s: float = 0.002, fail_after: int | None = None, block: int = 1):
        self.reply = reply.encode() if isinstance(reply, str) else reply
        self.max_seq_len = max_seq_len
        self.max_queue = max_queue
        self.step_s = step_s
        self.fail_after = fail_after
        self.block = block
        self.lock = threading.Lock()
        self.live: dict[str, dict] = {}
        self.submitted: list[tuple[list[int], Sampling]] = []
        self.generated: dict[str, list[int]] = {}  # every request's tokens, kept after it ended
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.counter = 0
        self.closed = False
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def submit(self, prompt_ids, sampling, on_update):
        with self.lock:
            if len(self.live) >= self.max_queue:
                raise QueueFull(f"{len(self.live)} requests held, the limit", retry_after=1.0)
            self.counter += 1
            rid = f"fake-{self.counter}"
            self.live[rid] = {"cb": on_update, "tokens": [], "max": sampling.max_new_tokens}
            self.generated[rid] = self.live[rid]["tokens"]
            self.submitted.append((list(prompt_ids), sampling))
        self.wake.set()
        return rid

    def cancel(self, request_id):
        with self.lock:
            if self.live.pop(request_id, None) is not None:
                self.cancelled.append(request_id)

    def metrics(self):
        with self.lock:
            return EngineMetrics(running=len(self.live), waiting=0, kv_bytes=64 * len(self.live),
                                 state_bytes=32 * len(self.live), free_bytes=4000 - 96 * len(self.live),
                                 reserved_bytes=96, total_bytes=4096, tokens_per_s=1.5, preemptions=3)

    def close(self, timeout=None):
        self.closed = True
        self.wake.set()
        self.thread.join(timeout)

    def _loop(self):
        codec = ByteCodec(1024)
        while not self.closed:
            with self.lock:
                items = list(self.live.items())
            if not items:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            for rid, r in items:
                status = "running"
                for _ in range(self.block):
                    k = len(r["tokens"])
                    if self.fail_after is not None and k == self.fail_after:
                        status = "failed"
                        break
                    r["tokens"].append(self.reply[k] + codec.offset if k < len(self.reply) else codec.eos_token_id)
                    if k >= len(self.reply) or k + 1 == r["max"]:
                        status = "finished"
                        break
                with self.lock:
                    if rid not in self.live:
                        continue
                    if status != "running":
                        del self.live[rid]
                        self.finished.append(rid)
                r["cb"](Update(rid, list(r["tokens"]), status, "scripted failure" if status == "failed" else None))
            time.sleep(self.step_s)
