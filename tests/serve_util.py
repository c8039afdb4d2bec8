"""A server on loopback for the serve tests: a tiny random model, a toy tokenizer, uvicorn
in a thread on a port the OS picked."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from forerun.config import SpeculativeConfig
from forerun.llm import LLM
from forerun.serve.main import build_server
from forerun.serve.scheduler import ServeConfig
from tests.tiny import tiny_model

VOCAB = 64
NAME = "tiny"


class ToyTokenizer:
    """One character per token: id i <-> chr(48 + i) (digits, letters, a few signs); id 63
    is EOS. Enough for prompts, stop strings, streaming and a chat template."""

    bos_token = None
    eos_token_ids = {63}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - 48) % 63 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(48 + i) for i in ids if i != 63 or not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role'][0]}>{m['content']}" for m in messages) + ("<a>" if add_generation_prompt else "")


def tiny_llm(dtype: str = "float32", seed: int = 0, kv_cache: str = "auto", **llm_options) -> LLM:
    model = tiny_model(seed=seed, dtype=dtype, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, logit_scale=4.0)
    if kv_cache != "auto":
        model.set_kv_cache(kv_cache)
    return LLM(model, dtype=dtype, tokenizer=ToyTokenizer(), **llm_options)


class Server:
    """`with Server(app) as s:` serves `app` at s.url until the block ends."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kw)


def tiny_server(dtype: str = "float32", k: int = 4, batch_aware: bool = False, kv_cache: str = "auto",
                spec: SpeculativeConfig | None = None, llm: LLM | None = None, **cfg) -> Server:
    """A server of tiny_llm(dtype) (or of `llm`): prompt lookup at k (0: plain decoding), or
    `spec` where given."""
    llm = llm or tiny_llm(dtype, kv_cache=kv_cache)
    spec = spec or (SpeculativeConfig("ngram", k, ngram_min=1) if k else None)
    conf = ServeConfig(**{"max_batch": 4, "max_len": 256, "block_size": 8, "batch_aware": batch_aware, **cfg})
    return Server(build_server(llm, spec, conf, default_max_tokens=16, names=(NAME,)))


def wait_idle(sched, timeout: float = 10.0) -> None:
    """Until nothing runs or waits (cancellations land at the next step boundary)."""
    deadline = time.time() + timeout
    while (sched.running or sched.waiting) and time.time() < deadline:
        time.sleep(0.02)
