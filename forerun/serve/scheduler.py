"""Continuous batching: one engine thread admits requests between steps, prefills them
into free cache rows, steps every running row together, and lets rows leave as they end.

    submit() ─► waiting (bounded) ──admit: free row + blocks──► prefilling ─► running
    prefilling ──one chunk of at most prefill_chunk tokens between two steps──► ... ─► running
    running ──step (engine.step per sampling group)──► tokens to each request's sink
    running ──the pool has no block for an older row's next token──► preempted: back at the
        head of waiting, its tokens kept; on return its K/V are read from the prefix cache or
        computed again (the same bits: prefill is batch-invariant), and it goes on exactly
    finished / failed / cancelled ─► row, blocks and drafter state released at once

KV memory: the block pool is sized from a budget (kv_cache_gb) and taken as blocks are first
written (kv/cache.py's lazy_zeros); a request holds the blocks its tokens fill, not its whole
max_tokens, so requests that may each run to the whole context share the pool, and when it
runs out the newest one waits (vLLM's recompute preemption) instead of being refused.

Each running request is an `engine.Sequence` in its own cache row; rows keep the engine's
invariant cache.lengths[row] == len(tokens) - 1, so a row that joins mid-flight is exactly
a row of a fresh generate() call. The drafter is started once for all rows and told when
a row changes hands (`release(row)`, for drafters with per-row state).

Chunked prefill: a long prompt is computed a chunk at a time between the running rows'
steps, so a newcomer with thousands of tokens never freezes the other streams for its whole
prefill. The forwards are batch-invariant (kernels/backend.py), so a prompt's K/V, and so
every token after them, are the same bits chunked or whole.
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from dataclasses import dataclass

import torch

from forerun import engine
from forerun.config import SpeculativeConfig
from forerun.errors import ConfigError, ForerunError
from forerun.logprobs import with_text
from forerun.sampling import make_generator
from forerun.serve.batch_k import BatchK
from forerun.kv.blocks import BlockAllocator, BlockTable
from forerun.kv.paged import PagedKVCache
from forerun.penalties import Penalties
from forerun.prefill import PrefixWrite
from forerun.serve.request import Event, ServeRequest
from forerun.serve.step import Live, first_tokens, step_all
from forerun.streaming import TextStream


class QueueFull(ForerunError):
    """The waiting queue is at its bound: the server answers 429."""


class TooLarge(ForerunError):
    """The request could never fit the KV block pool: the server answers 400."""


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int = 8  # cache rows: sequences decoded together
    max_len: int | None = None  # prompt + generated tokens per sequence; None: the model's context (or what the pool holds)
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None: what kv_cache_gb holds (at most every row at max_len)
    kv_cache_gb: float = 4.0  # the block pool's memory budget (taken as used)
    paged: bool = True  # K/V stored in the blocks (kv/paged.py), else in rows of max_len slots
    max_queue: int = 64  # waiting requests beyond which submit() raises QueueFull
    batch_aware: bool = True  # pick k (0 included) per batch size from measured throughput
    # Automatic prefix caching (kv/prefix.py): None = on where the precision is batch-invariant
    # (a hit never changes a token there), off elsewhere; True / False as asked.
    prefix_cache: bool | None = None
    prefix_cache_gb: float = 1.0  # memory the cached blocks may hold
    # Prompt tokens computed between two decoding steps (all newcomers together), at most; None:
    # whole prompts at admission.
    prefill_chunk: int | None = 128
    # While other streams run, a chunk is sized by the prefill rate measured on this machine to take
    # about this long (at least MIN_CHUNK tokens); None: always prefill_chunk tokens. (128 tokens of
    # the 1.5B at gguf take ~0.3 s with AVX512, ~3.5 s on a 2-core AVX2 CPU: a stream's gap.)
    prefill_chunk_seconds: float | None = 0.5

    def __post_init__(self):
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 token (None, or --prefill-chunk 0: whole prompts), got {self.prefill_chunk}")
        if self.prefill_chunk_seconds is not None and not self.prefill_chunk_seconds > 0:
            raise ConfigError(f"prefill_chunk_seconds must be > 0 (None, or --prefill-chunk-seconds 0: fixed chunks), "
                              f"got {self.prefill_chunk_seconds}")
        if not 0 < self.prefix_cache_gb < math.inf:
            raise ConfigError(f"prefix_cache_gb must be a finite number > 0, got {self.prefix_cache_gb}")
        if not 0 < self.kv_cache_gb < math.inf:
            raise ConfigError(f"kv_cache_gb must be a finite number > 0, got {self.kv_cache_gb}")
        if self.max_len is not None and self.max_len < 2:
            raise ConfigError(f"max_len must be >= 2 tokens, got {self.max_len}")


class Scheduler:
    def __init__(self, llm, spec: SpeculativeConfig | None, cfg: ServeConfig = ServeConfig(), metrics=None):
        self.llm, self.model, self.cfg, self.metrics = llm, llm.model, cfg, metrics
        self.spec = spec if spec is not None and spec.enabled else None
        self.k_max = self.spec.k_max if self.spec else 0
        self.forced_drafts = self.spec.forced_drafts if self.spec else True
        self.continue_forced = self.spec.continue_forced if self.spec else True
        self.drafter = llm.drafter_for(self.spec) if self.spec else None
        nodes = getattr(self.drafter, "max_draft_nodes", lambda k: k)(self.k_max) if self.drafter else 0
        self.block_bytes = kv_bytes_per_token(self.model) * cfg.block_size
        self.max_len, num_blocks = pool_plan(cfg, llm.max_context, nodes, self.block_bytes)
        self.capacity = self.max_len + nodes + 1
        self.blocks = BlockAllocator(num_blocks, cfg.block_size)
        if cfg.paged:
            self.cache = PagedKVCache(self.model, cfg.max_batch, self.capacity, self.blocks.num_blocks, cfg.block_size)
        else:  # position-indexed rows of max_len slots; the blocks are then accounting only
            self.cache = self.model.new_cache(cfg.max_batch, self.capacity)
        if self.drafter is not None:
            self.drafter.start(cfg.max_batch, self.capacity, self.cache)
        self.batch_k = BatchK(self.k_max) if self.spec and cfg.batch_aware else None
        self.prefix = self._prefix_pool(cfg)
        self._prefix_lock = threading.Lock()  # the engine thread's lookups / stores vs a reset from HTTP
        self.eos_ids = llm.eos_ids()
        self.free_rows = list(range(cfg.max_batch - 1, -1, -1))
        self.waiting: collections.deque[ServeRequest] = collections.deque()
        self.running: dict[int, Live] = {}  # row -> live sequence
        self.prefilling: dict[int, Prefill] = {}  # row -> a newcomer whose prompt is being computed
        self.generator = make_generator(None, self.model.device)  # unseeded sampling
        self.admitted = 0  # admissions so far: each Live's `order` (the newest is preempted first)
        self.prefill_rate: float | None = None  # prompt tokens a second, measured on the chunks (moving average)
        self.preemptions = 0
        self._cv = threading.Condition()
        self._calls: collections.deque = collections.deque()  # (future, fn, args) for the engine thread
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="forerun-engine", daemon=True)

    def _prefix_pool(self, cfg: ServeConfig):
        """The server's prefix cache (LLM.new_prefix_pool, at this server's block size); None
        where it is off. A drafter that reads the prompt's hidden states gets those of a cached
        prefix from it too (engine.read_blocks). Where the LLM made a pool of its own (built
        with the same choice, so that its draft model keeps one), it has already warned."""
        return self.llm.new_prefix_pool(cfg.prefix_cache, cfg.prefix_cache_gb, cfg.block_size,
                                        warn=self.llm.prefix_cache is None)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (POST /reset_prefix_cache), the draft model's own pool's too;
        returns how many of the verifier's. Call it on the engine thread (run_on_engine): the
        drafter reads and stores its pool there, without the lock."""
        draft_pool = getattr(self.drafter, "prefix", None)
        if draft_pool is not None:
            draft_pool.reset()
        if self.prefix is None:
            return 0
        with self._prefix_lock:
            return self.prefix.reset()

    # -- the HTTP side ---------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def submit(self, req: ServeRequest) -> None:
        with self._cv:
            if len(self.waiting) >= self.cfg.max_queue:
                raise QueueFull(f"queue full ({self.cfg.max_queue} waiting); retry later")
            if self.blocks_needed(req) > self.blocks.num_blocks:
                raise TooLarge(f"the request needs {self.blocks_needed(req)} KV blocks of {self.blocks.block_size} tokens; "
                               f"the server's pool has {self.blocks.num_blocks}")
            self.waiting.append(req)
            self._cv.notify()

    def blocks_needed(self, req: ServeRequest) -> int:
        """The most blocks `req` can hold: prompt + max_new tokens + its largest draft. More than
        the pool has: the request could never finish (TooLarge). Admission asks only for the
        prompt's blocks; a sequence grows a block at a time and preemption makes room."""
        nodes = getattr(self.drafter, "max_draft_nodes", lambda k: k)(req.k) if self.drafter and req.k else 0
        return self.blocks.blocks_for(len(req.prompt) + req.max_new + nodes)

    def run_on_engine(self, fn, *args) -> concurrent.futures.Future:
        """fn(*args) on the engine thread, between two steps; its result (or error) in the future.
        Model work the HTTP side needs (a completion's echoed prompt scored) goes here, so that the
        engine thread stays the one thread running torch's parallel work (serve/one_pool.py)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._calls.append((future, fn, args))
            self._cv.notify()
        return future

    def _run_calls(self, refuse: str | None = None) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                future, fn, args = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            if refuse is not None:
                future.set_exception(ForerunError(refuse))
                continue
            try:
                with torch.inference_mode():
                    future.set_result(fn(*args))
            except Exception as exc:  # the caller's to raise
                future.set_exception(exc)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    # -- the engine thread -----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.waiting and not self.running and not self.prefilling and not self._calls:
                    self._cv.wait()
                if self._stop:
                    break
            try:
                self._drop_cancelled()
                self._run_calls()
                self._admit()
                self._prefill_chunk()
                if self.running:
                    self._step()
            except Exception as exc:  # an engine bug must not kill the server: fail the batch
                self._fail_all(f"{type(exc).__name__}: {exc}")
        self._fail_all("server shutting down")
        self._run_calls(refuse="server shutting down")

    @torch.inference_mode()
    def _admit(self) -> None:
        """Rows for the waiting requests, oldest (and preempted ones) first, while the pool has
        blocks for the tokens each brings (a preempted one brings what it had generated too)
        and a block to spare for each admitted sequence's next step."""
        new: list[Live] = []
        while self.free_rows and self.waiting:
            with self._cv:
                item = self.waiting[0]
                tokens = len(item.seq.tokens) if isinstance(item, Live) else len(item.prompt) + 1
                spare = len(self._holding()) + len(new)
                if self.blocks.free - spare < self.blocks.blocks_for(tokens):
                    break  # FIFO: wait until running sequences return blocks
                table = BlockTable(self.blocks)
                table.ensure(tokens)
                self.waiting.popleft()
            row = self.free_rows.pop()
            new.append(self._resume(item, row, table) if isinstance(item, Live) else self._make_live(item, row, table))
        for lv in new:
            self.prefilling[lv.seq.row] = Prefill(lv, self._restore(lv))

    def _holding(self):
        """Every admitted sequence: running, or still prefilling."""
        return [*self.running.values(), *(p.live for p in self.prefilling.values())]

    @torch.inference_mode()
    def _prefill_chunk(self) -> None:
        """Compute the next prompt tokens of the prefilling rows (at most prefill_chunk in all,
        oldest first; every row's whole prompt when prefill_chunk is None); a row whose prompt
        is done joins the running ones."""
        if not self.prefilling:
            return
        t0 = time.perf_counter()
        left = sum(p.left for p in self.prefilling.values())
        cfg = self.cfg
        budget = left if cfg.prefill_chunk is None else chunk_tokens(
            cfg.prefill_chunk, cfg.prefill_chunk_seconds if self.running else None, self.prefill_rate)
        writes = []
        for p in self.prefilling.values():
            n = min(p.left, budget)
            if n <= 0:
                continue
            writes.append((p, n))
            budget -= n
        hidden = engine.write_known(self.model, self.cache, [PrefixWrite(p.live.seq.row, p.done, p.live.seq.tokens[p.done : p.done + n])
                                                             for p, n in writes], self.drafter)
        firsts = {p.live.seq.row: h for (p, n), h in zip(writes, hidden) if n == p.left and p.first}
        for p, n in writes:
            p.done += n
            p.live.seq.stats.prefill_chunks += 1
        completed = [row for row, p in self.prefilling.items() if p.left == 0]
        for row in completed:
            self.cache.truncate(row, self.prefilling[row].done)
            self.running[row] = self.prefilling.pop(row).live
        if firsts:  # the first tokens, from the prompts' last logits, go out before anything else runs
            first_tokens(self, [self.running[row] for row in firsts], firsts)
        for row in completed:  # (the engine's invariant from here on: lengths[row] == len(tokens) - 1)
            if row in self.running:  # a request with the same prefix arriving meanwhile reads its blocks
                self._store_blocks(self.running[row])
        feed = getattr(self.drafter, "observe_prefix", None)  # a draft model's cache takes the same chunks
        drafting = [(p.live.seq.row, p.live.seq.tokens, p.done, p.live.req.cache_salt) for p, _ in writes
                    if p.live.req.k and p.live.seq.finish_reason is None]
        if feed is not None and drafting:
            feed(drafting)
        dt = time.perf_counter() - t0
        done = sum(n for _, n in writes)
        if done >= MIN_CHUNK and dt > 0:
            rate = done / dt
            self.prefill_rate = rate if self.prefill_rate is None else 0.5 * (self.prefill_rate + rate)
        for p, _ in writes:
            p.live.seq.stats.prefill_time += dt
        for row in firsts:
            lv = self.running.get(row)
            if lv is not None and lv.seq.finish_reason is not None:  # its first token ended it
                self._finish(lv, Event(finish_reason=lv.seq.finish_reason))
        if self.metrics:
            self.metrics.on_prefill(sum(n for _, n in writes), dt)

    def _make_live(self, req: ServeRequest, row: int, table: BlockTable) -> Live:
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(row)
        seq = engine.Sequence(row, list(req.prompt), len(req.prompt), req.max_new, tenant=req.cache_salt)
        if req.params.logprobs is not None:
            seq.logprobs, seq.top_logprobs = [], req.params.logprobs
        if req.grammar is not None:
            seq.matcher = req.grammar.matcher()
        seq.penalties = Penalties.of(req.params)
        self.sync_table(row, table.blocks)
        emit = lambda _i, text: req.sink(Event(text=text, completion_tokens=len(seq.generated), logprobs=_new_logprobs(live)))  # noqa: E731
        stream = TextStream(self.llm.decode, req.params.stop, emit)
        live = Live(req, seq, table, stream, time.perf_counter(), piece=self.llm.token_text, order=self.admitted)
        self.admitted += 1
        return live

    def _resume(self, lv: Live, row: int, table: BlockTable) -> Live:
        """A preempted sequence back in a row (maybe another): its tokens, grammar and penalty
        state, generator and stream as it left them; its K/V to be read or computed again."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(row)
        lv.seq.row, lv.table = row, table
        self.sync_table(row, table.blocks)
        return lv

    def preempt_newest(self, needy: Live) -> bool:
        """Make room for `needy`'s next token: preempt the newest admitted sequence (a prefilling
        one, or a running one; `needy` itself when it is the newest). False when nothing else
        holds blocks (the pool cannot hold even `needy`)."""
        holding = self._holding()
        if all(lv is needy for lv in holding):
            return False
        self._preempt(max(holding, key=lambda lv: lv.order))
        return True

    def _preempt(self, lv: Live) -> None:
        """Give back lv's row and blocks and put it at the head of the queue, its blocks first
        stored in the prefix cache (where on) so that its return reads them back."""
        if lv.seq.row in self.running:
            self._store_blocks(lv)
        self._release(lv)
        lv.preempted += 1
        self.preemptions += 1
        with self._cv:
            self.waiting.appendleft(lv)
        if self.metrics:
            self.metrics.on_preempt()

    def _step(self) -> None:
        t0 = time.perf_counter()
        lives = list(self.running.values())
        before = sum(len(lv.seq.generated) for lv in lives)
        catch_up = getattr(self.drafter, "catch_up_seconds", 0.0)
        prompt = getattr(self.drafter, "prompt_seconds", 0.0)
        drafted, accepted, k = step_all(self, lives)
        dt = time.perf_counter() - t0
        if self.batch_k is not None and k is not None:  # the drafter's one-time catch-up is not k's steady cost
            overhead = getattr(self.drafter, "catch_up_seconds", 0.0) - catch_up
            prompt = getattr(self.drafter, "prompt_seconds", 0.0) - prompt
            emitted = sum(len(lv.seq.generated) for lv in lives) - before
            steady = max(dt - overhead - prompt, 1e-6)
            self.batch_k.record(len(lives), k, emitted, steady, overhead=overhead, prompt=prompt)
        for lv in lives:
            lv.seq.stats.decode_time = time.perf_counter() - lv.t_admit - lv.seq.stats.prefill_time
            if lv.seq.finish_reason is not None:
                self._finish(lv, Event(finish_reason=lv.seq.finish_reason))
        if self.metrics:
            self.metrics.on_step(len(lives), dt, drafted, accepted)

    def _restore(self, lv: Live) -> int:
        """Copy the cached blocks that start this sequence into its row; the tokens they cover."""
        if self.prefix is None:
            return 0
        with self._prefix_lock:
            n = engine.read_blocks(self.prefix, self.drafter, lv.seq, self.cache)
        if not lv.preempted:  # (the prompt's cached tokens, as usage reports them)
            lv.seq.stats.cached_tokens = n
        return n

    def _keep(self, lv: Live) -> None:
        """Store the blocks the row computed (prompt and answer: the next turn resends both),
        and the drafter's own (a draft model's cache) where it keeps them."""
        retire = getattr(self.drafter, "retire", None)
        if retire is not None:
            retire(engine.retiring(lv.seq))
        self._store_blocks(lv)

    def _store_blocks(self, lv: Live) -> None:
        """The blocks lv's row computed (whole, and its last partial one), into the prefix cache (where it is on)."""
        if self.prefix is not None:
            with self._prefix_lock:
                engine.keep_blocks(self.prefix, self.drafter, lv.seq, self.cache)

    def _release(self, lv: Live) -> None:
        """lv leaves its row (finished, failed, cancelled or preempted): the row, its blocks back."""
        self.running.pop(lv.seq.row, None)
        self.prefilling.pop(lv.seq.row, None)
        lv.table.release()
        self.sync_table(lv.seq.row, [])
        self.free_rows.append(lv.seq.row)

    def _finish(self, lv: Live, last: Event) -> None:
        """Release the row and its blocks, then tell the consumer (exactly once)."""
        if last.error is None and lv.seq.row not in self.prefilling:
            self._keep(lv)
        self._release(lv)
        _last(lv, last)
        last.logprobs = _new_logprobs(lv)
        if self.metrics:
            self.metrics.on_finish(lv, last)
        lv.req.sink(last)

    def sync_table(self, row: int, blocks: list[int]) -> None:
        """Point a paged cache's row at its sequence's blocks (after admission and growth)."""
        if isinstance(self.cache, PagedKVCache):
            self.cache.set_table(row, blocks)

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self.waiting if _request(r).cancelled.is_set()]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            _request(r).sink(_last(r, Event(finish_reason="cancelled")))
        for lv in [lv for lv in self._holding() if lv.req.cancelled.is_set()]:
            self._finish(lv, Event(finish_reason="cancelled"))

    def _fail_all(self, message: str) -> None:
        for lv in self._holding():
            self._finish(lv, Event(error=message))
        with self._cv:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for r in waiting:
            _request(r).sink(_last(r, Event(error=message)))


@dataclass
class Prefill:
    """A newcomer whose prompt is computed a chunk at a time (its K/V for tokens[:done])."""

    live: Live
    done: int  # prompt tokens with K/V (the prefix cache's, then the chunks computed)

    @property
    def first(self) -> bool:
        """A prompt without a token yet: its last token's logits give the first (a preempted
        sequence back in a row has its pending token already)."""
        return not self.live.seq.generated

    @property
    def left(self) -> int:
        """Tokens still to compute: the whole prompt for a newcomer, every token but the pending
        one for a preempted sequence."""
        return len(self.live.seq.tokens) - (0 if self.first else 1) - self.done


MIN_CHUNK = 16  # tokens: a chunk sized by time computes at least this many


def chunk_tokens(cap: int, seconds: float | None, rate: float | None) -> int:
    """Prompt tokens for the next chunk: what `rate` (tokens a second, measured) computes in
    `seconds`, between MIN_CHUNK and `cap`; `cap` where there is no time to keep (nobody waits:
    seconds None) and MIN_CHUNK before the first measurement.
    >>> chunk_tokens(128, 0.5, 36.0), chunk_tokens(128, 0.5, 900.0), chunk_tokens(128, None, 36.0), chunk_tokens(128, 0.5, None)
    (18, 128, 128, 16)
    """
    if seconds is None:
        return cap
    if rate is None:
        return min(MIN_CHUNK, cap)
    return max(min(MIN_CHUNK, cap), min(cap, int(rate * seconds)))


def _request(item: ServeRequest | Live) -> ServeRequest:
    """A waiting entry's request (a preempted sequence waits as its Live)."""
    return item.req if isinstance(item, Live) else item


def _last(item: ServeRequest | Live, last: Event) -> Event:
    """A request's last event with what its sequence generated (a waiting entry that was never
    admitted has none)."""
    if isinstance(item, Live):
        last.completion_tokens, last.stats, last.token_ids = len(item.seq.generated), item.seq.stats, item.seq.generated
    return last


def kv_bytes_per_token(model) -> int:
    """The verifier's K and V bytes for one token, every layer."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * torch.empty((), dtype=model.kv_dtype).element_size()


def budget_blocks(cfg: ServeConfig, block_bytes: int) -> int:
    """The KV blocks kv_cache_gb holds."""
    return int(cfg.kv_cache_gb * 2**30 // block_bytes)


def pool_plan(cfg: ServeConfig, context: int, nodes: int, block_bytes: int) -> tuple[int, int]:
    """(max_len, blocks in the pool). max_len: cfg's, else the model's context, else (a budget
    that holds less) what the pool holds; blocks: cfg.num_blocks, else what kv_cache_gb holds, at
    most every row at max_len. One sequence of max_len must fit the pool (alone, every request
    can finish, so preemption always makes progress): where it does not, a max_len asked for is
    a ConfigError, a defaulted one is lowered to fit."""
    bs = cfg.block_size
    max_len = min(cfg.max_len or context, context)
    if cfg.num_blocks is not None:
        num_blocks = cfg.num_blocks
    else:
        rows_worth = cfg.max_batch * -(-(max_len + nodes + 1) // bs)
        num_blocks = min(rows_worth, budget_blocks(cfg, block_bytes))
    if num_blocks < 1:
        raise ConfigError(f"kv_cache_gb {cfg.kv_cache_gb} holds no KV block of {block_bytes} bytes; raise it")
    fits = num_blocks * bs - nodes - 1  # the longest sequence the pool holds
    if max_len > fits:
        if cfg.max_len is not None:
            what = f"num_blocks {cfg.num_blocks}" if cfg.num_blocks is not None else f"kv_cache_gb {cfg.kv_cache_gb}"
            raise ConfigError(f"max_len {cfg.max_len} does not fit the KV pool: {what} holds {num_blocks} blocks of {bs} "
                              f"tokens, {max(fits, 0)} tokens a sequence; raise it or lower max_len")
        max_len = fits
        if max_len < 2:
            raise ConfigError(f"the KV pool holds {num_blocks} blocks of {bs} tokens: no room for a sequence; raise kv_cache_gb")
    return max_len, num_blocks


def _new_logprobs(lv: Live) -> list | None:
    """The logprobs (with their tokens' text) of the tokens generated since the last event that
    carried some; None when the request did not ask for them."""
    if lv.seq.logprobs is None:
        return None
    fresh = lv.seq.logprobs[lv.logprobs_sent :]
    lv.logprobs_sent += len(fresh)
    return with_text(fresh, lv.piece)
