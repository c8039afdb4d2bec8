"""A separate, smaller model with the verifier's tokenizer drafts k tokens autoregressively.

It keeps its own position-indexed KV cache, re-synced each step from the committed
tokens: entries whose tokens were accepted stay, the rest are overwritten. The special
case worth spelling out: when all k drafts are accepted, the last draft token was never
fed to the drafter, so the next step's catch-up feeds two tokens (it and the bonus).

Lookup (options["draft_lookup"] = n, off by default): the step's first forward also feeds
what followed the last n..ngram_max tokens earlier in the context (prompt lookup's guess,
up to k - 1 tokens). Each drafted token is still drawn from the drafter's own distribution;
while it equals the guess, the logits at the guess's position are the next token's, so
one forward drafts as many tokens as the drafter agrees with the guess, plus one. Code
and summaries copy their context: there most steps need one or two drafter forwards, not k.
"""
from __future__ import annotations

import dataclasses

import itertools
import time

import torch

from forerun.config import SamplingParams
from forerun.drafters.base import Draft, DraftRequest, register
from forerun.drafters.draft_vocab import for_rows, forget_row, reduced_head, reset_rows
from forerun.drafters.ngram import find_continuation
from forerun.errors import ConfigError
from forerun.kv.cache import KVCache, chain_batch
from forerun.precision import follow_kv_cache
from forerun.prefill import PrefixWrite, feed_all_but_last, write_prefixes
from forerun.sampling import draw, sample_many


# A drafting step's usual catch-up, the last draft token and the bonus token after a fully
# accepted draft, rides in the step's first forward instead of a forward of its own (a
# forward of 2 tokens costs about one of 1: the weights are read once); longer feeds (a new
# prompt, steps skipped without drafting) are written first, in budgeted forwards.
INLINE_FEED = 2


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, model, tree_width: int = 1, vocab_size: int | None = None, head=None, p_min: float = 0.0,
                 lookup: tuple[int, int] | None = None, prefix=None):
        self.model = model
        # The draft model's own prefix cache (kv/prefix.py, its LLM's): a prompt's blocks that an
        # earlier request's rows held are copied in instead of fed again; kept when a row retires.
        self.prefix = prefix
        self.p_min = p_min  # stop a row's draft where the drafter's top probability falls below this (llama.cpp's p_min)
        self.lookup = lookup  # (n_max, n_min): prompt-lookup guesses checked in the first forward; None: off
        self.vocab_size = vocab_size or model.config.vocab_size  # the verifier's logit width
        self.tree_width = tree_width  # >1: extra candidates for the first drafted position
        self.head = head  # draft_vocab: a ReducedHead (or ContextHead: + the rows' context ids); None: the model's own LM head
        self.cache = None
        self.synced: dict[int, int] = {}  # row -> committed tokens whose KV is in the draft cache
        self.tail: dict[int, list[int]] = {}  # row -> drafted tokens written right after them
        # Seconds spent feeding tokens a row skipped while steps ran without drafting (its share
        # of each catch-up forward): a one-time cost of switching drafting back on, which the
        # server's batch-aware k keeps out of the per-step rates it compares (serve/scheduler.py).
        # A new row's prompt is fed the same way but timed in `prompt_seconds`: every request
        # pays it once drafting is on at all, so batch-aware k charges it to the step's k.
        self.catch_up_seconds = 0.0
        self.prompt_seconds = 0.0
        self.fed_tokens = 0  # tokens behind those two figures (their seconds per token: the cost of a feed)
        self.guessed_tokens = 0  # lookup: tokens drafted at a guess's position (each one a drafter forward saved)

    def max_draft_nodes(self, k: int) -> int:
        return k + self.tree_width - 1

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        self.cache = self.model.new_cache(num_rows, capacity)
        self.synced, self.tail = {}, {}
        reset_rows(self.head)

    def retire(self, r: DraftRequest) -> None:
        """The sequence in r.row ended with r.tokens: keep the draft cache's blocks of it (under its tenant's salt)."""
        if self.prefix is not None and self.cache is not None and self.synced.get(r.row):
            self.prefix.store(r.tokens, self.cache, r.row, min(self.synced[r.row], len(r.tokens) - 1), r.tenant)

    def _restore(self, row: int, tokens: list[int], salt: bytes) -> int:
        """Copy the cached K/V that start a new row's tokens into the draft cache (the tenant's
        own: `salt` as the verifier's prefix cache has it); the tokens they cover."""
        return self.prefix.read(tokens, self.cache, row, salt) if self.prefix is not None else 0

    def release(self, row: int) -> None:
        """A new sequence takes this row (the server's continuous batching)."""
        self.synced.pop(row, None)
        self.tail.pop(row, None)
        forget_row(self.head, row)

    @torch.inference_mode()
    def observe_prompts(self, prompts: list[tuple[int, list[int]]], salt: bytes = b"") -> None:
        """(row, tokens) of a generate call, in its prefill: write each row's tokens but the
        last (pending: the prefill's first token) into the draft cache now, as the verifier's
        prefill wrote the prompt (llama.cpp's speculative example evaluates the prompt with both
        models before decoding too), so the first drafting step feeds one token like every
        other and the prompt's cost is counted as prefill, not as drafting."""
        feeds = [(row, toks) for row, toks in prompts if len(toks) > 1 and row not in self.synced]
        if not feeds:
            return
        t0 = time.perf_counter()
        starts = [self._restore(row, toks, salt) for row, toks in feeds]
        feed_all_but_last(self.model, self.cache, [row for row, _ in feeds], [(n, toks[n:]) for n, (_, toks) in zip(starts, feeds)])
        for row, toks in feeds:
            self.synced[row], self.tail[row] = len(toks) - 1, []
        self.fed_tokens += sum(len(toks) - 1 - n for n, (_, toks) in zip(starts, feeds))
        self.prompt_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def observe_prefix(self, items: list[tuple[int, list[int], int, bytes]]) -> None:
        """The server's chunked prefill: (row, its tokens, end, salt) says the verifier's cache now
        holds the row's tokens[:end]. Write what the draft cache lacks of them (a new row first
        reads its own cached blocks), so a long prompt reaches the drafter a chunk at a time between
        the other rows' steps too, and its first drafting step feeds one token, not the prompt."""
        t0, writes = time.perf_counter(), []
        for row, toks, end, salt in items:
            if row not in self.synced:
                self.synced[row], self.tail[row] = self._restore(row, toks[: end + 1], salt), []
            if self.synced[row] < end:
                writes.append(PrefixWrite(row, self.synced[row], toks[self.synced[row] : end]))
                self.synced[row], self.tail[row] = end, []
        if writes:
            write_prefixes(self.model, self.cache, writes)
            self.fed_tokens += sum(len(w.tokens) for w in writes)
            self.prompt_seconds += time.perf_counter() - t0

    def unfed(self, row: int, tokens: list[int]) -> int:
        """Tokens of a row the next drafting step would feed beyond a drafting step's usual 1-2
        (a new prompt, or tokens committed while steps ran without drafting)."""
        return max(0, len(tokens) - self.synced.get(row, 0) - 2)

    def _catch_up(self, r: DraftRequest) -> tuple[int, list[int]]:
        """(first slot to write, tokens to feed) so the cache covers r.tokens[:-1] and the
        last logits predict the token after r.tokens."""
        start = self.synced.get(r.row, 0)
        for tok in self.tail.get(r.row, []):  # drafted entries that the verifier accepted
            if start < len(r.tokens) - 1 and r.tokens[start] == tok:
                start += 1
            else:
                break
        start = min(start, len(r.tokens) - 1)
        return start, r.tokens[start:]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], params: SamplingParams, generator) -> list[Draft]:
        live = [r for r in requests if r.k > 0]
        out = {r.row: ([], []) for r in live}  # row -> (drafted tokens, their q rows)
        siblings: dict[int, tuple[list[int], torch.Tensor | None]] = {}  # row -> extra first tokens
        fed_all: set[int] = set()  # rows stopped by p_min: their last drafted token's K/V is written too
        feeds = [self._catch_up(r) for r in live]
        for i, r in enumerate(live):  # a new row's prompt: its cached blocks first
            if r.row not in self.synced and feeds[i][0] == 0 and len(feeds[i][1]) > INLINE_FEED:
                n = self._restore(r.row, r.tokens, r.tenant)
                feeds[i] = (n, r.tokens[n:])
        for_rows(self.head, live)
        starts, new = [s for s, _ in feeds], [toks for _, toks in feeds]
        long = [i for i, (_, toks) in enumerate(feeds) if len(toks) > INLINE_FEED]  # prompts, skipped steps
        if long:
            t0 = time.perf_counter()
            l_starts, l_new = feed_all_but_last(self.model, self.cache, [live[i].row for i in long], [feeds[i] for i in long])
            for j, i in enumerate(long):
                starts[i], new[i] = l_starts[j], l_new[j]
            total = sum(len(feeds[i][1]) for i in long)
            fresh = sum(len(feeds[i][1]) for i in long if live[i].row not in self.synced)  # new prompts
            skipped = sum(len(feeds[i][1]) - 2 for i in long if live[i].row in self.synced)  # a drafting step feeds 1-2 per row
            seconds = time.perf_counter() - t0
            self.fed_tokens += fresh + skipped
            self.prompt_seconds += seconds * fresh / total
            self.catch_up_seconds += seconds * skipped / total
        fed = [len(t) for t in new]  # committed tokens first; then the lookup's guesses (step 0 only)
        new = [t + g for t, g in zip(new, self._guesses(live))]
        step = 0
        while live:
            batch = chain_batch(new, starts, [r.row for r in live], self.model.device)  # step 0: 1-2 + guesses; then 1
            at = [list(range(f - 1, len(t))) for f, t in zip(fed, new)]  # the last fed token's position, each guess's
            toks, q, logits = self._draw(batch, at, params, generator)  # N = positions over the rows, in order
            first = [0, *itertools.accumulate(len(a) for a in at)][:-1]  # each row's first position in [N]
            if step == 0 and self.tree_width > 1:
                siblings = self._siblings(logits[first], None if q is None else q[first], [r.row for r in live],
                                          params, generator)
            sure = self._confident(logits, q, toks)  # [N] bools
            keep, took = [], []
            for i, r in enumerate(live):
                o, guess, drafted = first[i], new[i][fed[i]:], out[r.row][0]
                for j in range(len(at[i])):
                    if not sure[o + j]:  # no token here, and no more for this row: all it drafted was fed
                        fed_all.add(r.row)
                        break
                    drafted.append(toks[o + j])
                    self.guessed_tokens += j > 0
                    if q is not None:
                        out[r.row][1].append(q[o + j])
                    if len(drafted) == r.k or j == len(guess) or toks[o + j] != guess[j]:
                        if len(drafted) < r.k:  # the logits past a guess the draw left are not this draft's
                            keep.append(i)
                            took.append(j + 1)
                        break
            starts = [starts[i] + fed[i] + n - 1 for i, n in zip(keep, took)]  # the last drafted token goes there
            new, live = [[out[live[i].row][0][-1]] for i in keep], [live[i] for i in keep]
            fed, step = [1] * len(live), step + 1
        for r in requests:
            if r.k > 0:  # cache now covers r.tokens, then every drafted token but the last (all: p_min stops)
                toks = out[r.row][0]
                self.synced[r.row], self.tail[r.row] = len(r.tokens), toks if r.row in fed_all else toks[:-1]
        drafts = [Draft.of(*out[r.row]) if r.k > 0 and out[r.row][0] else Draft([]) for r in requests]
        return [self._with_siblings(d, siblings.get(r.row)) for d, r in zip(drafts, requests)]

    def _confident(self, logits: torch.Tensor, q: torch.Tensor | None, toks: list[int]) -> list[bool]:
        """[B] whether to keep drafting: the drafter's most likely next token has probability
        >= p_min (always true when p_min is 0). The test reads q's maximum, not the drawn
        token's probability: a rule that looked at the draw would keep some draws and drop
        others, and the kept ones would no longer follow q (sampling would stop being exact;
        tests/test_statistical.py catches that). Like this, only the draft's length changes."""
        if self.p_min <= 0:
            return [True] * len(toks)
        probs = q if q is not None else torch.softmax(logits.float(), dim=-1)  # greedy: the drafter's own softmax
        return (probs.amax(dim=-1) >= self.p_min).tolist()

    def _guesses(self, live: list[DraftRequest]) -> list[list[int]]:
        """Per row, up to k - 1 tokens prompt lookup expects after its tokens ([] when off)."""
        if self.lookup is None:
            return [[] for _ in live]
        n_max, n_min = self.lookup
        return [find_continuation(r.tokens, n_max, n_min, r.k - 1) for r in live]

    def _draw(self, batch, at: list[list[int]], params: SamplingParams, generator):
        """(tokens [N], q [N, V] or None, logits [N, V] or None) at positions at[b] of each row
        b. Greedy over a reduced head with nothing else reading the logits (no siblings, no
        p_min): only the head's pick, no verifier-wide rows (logits None)."""
        if self.head is not None and params.greedy and self.tree_width == 1 and self.p_min <= 0:
            return self.head.pick(self._hidden(batch, at)), None, None
        logits = self._logits(batch, at)
        return *draw(logits, params, generator), logits

    def _hidden(self, batch, at: list[list[int]]) -> torch.Tensor:
        """[N, H]: the last hidden states at positions at[b] of each row b (rows in order)."""
        dev = self.model.device
        rows = torch.tensor([b for b, a in enumerate(at) for _ in a], device=dev)  # [N]
        hidden = self.model(batch, self.cache, logits_at=None).hidden  # [B, T, H]
        return hidden[rows, torch.tensor([p for a in at for p in a], device=dev)]

    def _logits(self, batch, at: list[list[int]]) -> torch.Tensor:
        """[N, V]: the logits at positions at[b] of each row b (rows in order), over the
        verifier's vocabulary."""
        if self.head is None and batch.tokens.shape[1] == 1:  # one token a row: its logits, nothing to pick
            return fit_vocab(self.model(batch, self.cache, logits_at="all").logits[:, 0], self.vocab_size)
        if self.head is None:
            dev = self.model.device
            rows = torch.tensor([b for b, a in enumerate(at) for _ in a], device=dev)  # [N]
            width = max(len(a) for a in at)
            idx = torch.tensor([a + a[-1:] * (width - len(a)) for a in at], device=dev)  # [B, P], ragged rows padded
            logits = self.model(batch, self.cache, logits_at=idx).logits  # [B, P, V]
            slot = torch.tensor([j for a in at for j in range(len(a))], device=dev)  # [N]
            return fit_vocab(logits[rows, slot], self.vocab_size)
        return self.head(self._hidden(batch, at))

    def _siblings(self, logits, q, rows, params: SamplingParams, generator):
        """Extra first-position candidates. Greedy: the next-best distinct tokens (a
        deterministic tree). Sampling: more independent draws from the same q, duplicates
        kept, because recursive rejection sampling is exact for i.i.d. siblings only."""
        w = self.tree_width - 1
        if params.greedy:
            top = logits.topk(w + 1, dim=-1).indices[:, 1:].tolist()
            return {row: (top[i], None) for i, row in enumerate(rows)}
        extra = sample_many(q, w, generator).tolist()
        return {row: (extra[i], q[i]) for i, row in enumerate(rows)}

    @staticmethod
    def _with_siblings(d: Draft, extra) -> Draft:
        if extra is None or not d.tokens:
            return d
        toks, q0 = extra
        parents = d.parent_list() + [-1] * len(toks)
        probs = None if d.probs is None else torch.cat([d.probs, q0.expand(len(toks), -1)])
        return Draft(d.tokens + toks, probs, parents)


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Same tokenizer, different padding of the embedding matrix (e.g. Qwen sizes): ids the
    verifier lacks get -inf, ids the draft lacks are appended at -inf, so q has p's width."""
    V = logits.shape[-1]
    if V > vocab:
        return logits[..., :vocab]
    if V < vocab:
        return torch.nn.functional.pad(logits, (0, vocab - V), value=float("-inf"))
    return logits


# A drafter named by path or name (not an LLM object) gets the configuration measured fastest on
# the Qwen pair (docs/results.md, "gguf against llama.cpp" and "The reduced draft vocabulary"):
# the drafter at int4, its head cut to 32768 ids, prompt lookup checked by its first forward.
# None of them changes the output: a drafter's precision and head only move acceptance.
NAMED_DRAFT_VOCAB, NAMED_DRAFT_LOOKUP, LARGE_VOCAB = 32768, 1, 65536


def named_draft_dtype(verifier) -> str:
    """int4 on the CPU where forerun's kernels are built (the fastest drafter measured under
    every verifier precision); else the verifier's dtype (auto for a gguf verifier)."""
    from forerun.kernels import loader as kernel_loader

    if verifier.model.device.type == "cpu" and verifier.dtype in ("gguf", "float32", "int8", "int4") \
            and kernel_loader.load() is not None:
        return "int4"
    return "auto" if verifier.dtype == "gguf" else verifier.dtype


def with_named_defaults(spec, vocab: int):
    """spec with draft_vocab (a vocabulary over 65536 ids) and draft_lookup set where the user left them unset.
    >>> from forerun.config import SpeculativeConfig
    >>> with_named_defaults(SpeculativeConfig("draft_model", 4), 151936).options
    {'draft_vocab': 32768, 'draft_lookup': 1}
    >>> with_named_defaults(SpeculativeConfig("draft_model", 4, options={"draft_lookup": 0}), 49152).options
    {'draft_lookup': 0}
    """
    defaults = {"draft_vocab": NAMED_DRAFT_VOCAB} if vocab > LARGE_VOCAB else {}
    defaults["draft_lookup"] = NAMED_DRAFT_LOOKUP
    return dataclasses.replace(spec, options={**defaults, **spec.options})


def _same_vocab(a, b) -> bool:
    """Tokenizers decide when both models have one; otherwise the logit widths."""
    if a.tokenizer is not None and b.tokenizer is not None:
        return a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
    return a.model.config.vocab_size == b.model.config.vocab_size


@register("draft_model")
def _make(spec, verifier, **_) -> DraftModelDrafter:
    src = spec.draft_model
    if src is None:
        raise ConfigError("method 'draft_model' needs draft_model= (a model folder, .gguf, hub id or LLM)")
    if hasattr(src, "model") and hasattr(src, "tokenizer"):  # an LLM already built
        draft = src
    else:  # loaded as the verifier was (its class: forerun.llm.LLM), so drafters never import the LLM
        dtype = spec.draft_dtype or named_draft_dtype(verifier)
        # (its prefix cache on where the verifier's is: off for the tools that time repeated runs;
        # its KV cache in the verifier's kv_cache_dtype where its activations are float32 too)
        draft = type(verifier)(model=src, dtype=dtype, speculative=None, device=verifier.model.device,
                               enable_prefix_caching=None if getattr(verifier, "prefix_cache", None) is not None else False,
                               kv_cache_dtype=follow_kv_cache(verifier.precision.kv_cache, dtype))
        spec = with_named_defaults(spec, draft.model.config.vocab_size)
    if draft.model.device != verifier.model.device:
        raise ConfigError(f"draft model is on {draft.model.device}, the verifier on {verifier.model.device}")
    if _same_vocab(draft, verifier):
        vocab = verifier.model.config.vocab_size
        p_min = float(spec.options.get("draft_p_min", 0.0))
        if not 0.0 <= p_min < 1.0:
            raise ConfigError(f"draft_p_min must be in [0, 1), got {p_min}")
        n = int(spec.options.get("draft_lookup", 0))
        if n < 0 or n > spec.ngram_max:
            raise ConfigError(f"draft_lookup must be in 0..ngram_max ({spec.ngram_max}), got {n}")
        lookup = (spec.ngram_max, n) if n else None
        return DraftModelDrafter(draft.model, spec.tree_width, vocab, reduced_head(spec, draft, vocab), p_min, lookup,
                                 prefix=getattr(draft, "prefix_cache", None))
    if draft.tokenizer is None or verifier.tokenizer is None:
        raise ConfigError(
            "the draft model's vocabulary differs from the verifier's and there are no tokenizers to bridge "
            "them; give both models their tokenizers for cross-tokenizer drafting"
        )
    if spec.tree_width > 1:
        raise ConfigError("tree_width > 1 needs a draft model with the verifier's tokenizer")
    from forerun.drafters.cross_tokenizer import CrossTokenizerDrafter

    return CrossTokenizerDrafter(draft.model, draft.tokenizer, verifier.tokenizer, verifier.model.config.vocab_size)
