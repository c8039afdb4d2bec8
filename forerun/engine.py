"""The generate loop: prefill, then draft -> verify -> commit -> emit until every row stops.

Plain decoding is the same loop with empty drafts, so speculative and plain runs share
every line but the drafter call. The prefill computes every prompt token and samples the first
token from the last one's logits (so the first token costs no step of its own, as in any
server). From then on, per sequence (cache row):
    cache.lengths[row] == len(seq.tokens) - 1
i.e. the last committed token is *pending*: its K/V is written by the next forward,
which feeds [pending] + draft and so scores the draft and the next position at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from forerun.config import SamplingParams
from forerun import penalties
from forerun.constrain import first_branch, follow, forced_run, mask_logits, shape_draft
from forerun.penalties import Penalties
from forerun.drafters.base import Draft, Drafter, DraftRequest, HiddenRows, StepFeedback
from forerun.kv.cache import KVCache, chain_batch, tree_batch
from forerun.kv.prefix import PrefixPool
from forerun.logprobs import sequence_logprobs
from forerun.metrics import SpecStats
from forerun.prefill import PrefixWrite, write_prefixes
from forerun.sampling import logits_to_probs, make_generator
from forerun.verify import (TypicalRule, greedy_verify, rejection_verify, tree_verify, typical_tree_verify_lossy,
                            typical_verify_lossy)


@dataclass
class Sequence:
    row: int
    tokens: list[int]  # prompt + generated; tokens[-1] is pending (no K/V yet)
    prompt_len: int
    max_new: int
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None  # "stop" (EOS / stop string) or "length"
    logprobs: list | None = None  # one TokenLogprobs per generated token, when asked for (top_logprobs)
    top_logprobs: int | None = None  # N alternatives per token; None = no logprobs kept
    tenant: bytes = b""  # the prefix cache's salt: whose request (DraftRequest.tenant)
    matcher: object | None = None  # structured output: this row's grammar state (structured.RowMatcher)
    penalties: Penalties | None = None  # logit_bias and repetition penalties of this row (penalties.py)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.generated)


@dataclass
class GenerateJob:
    """Everything one generate call needs besides the model."""

    prompts: list[list[int]]  # token ids per sequence (non-empty)
    params: SamplingParams
    max_new: list[int]  # per sequence, already clipped to the context
    drafter: Drafter | None = None
    k: int = 0
    eos_ids: frozenset[int] = frozenset()
    should_stop: Callable[[int, list[int]], bool] | None = None  # (seq index, generated ids) -> stop?
    on_tokens: Callable[[int, list[int], bool], None] | None = None  # streaming: (seq index, generated ids, finished)
    k_policy: object | None = None  # an adaptive.AdaptiveK: k per row and step (k is then the maximum)
    typical: TypicalRule | None = None  # acceptance="typical_lossy" (sampling only); None = exact
    prefix: PrefixPool | None = None  # automatic prefix caching: blocks read before prefill, kept after
    cache_salt: bytes = b""  # the tenant's part of the prefix keys (a block of another salt never matches)
    grammar: object | None = None  # structured.CompiledGrammar every sequence's output follows (None: free)
    forced_drafts: bool = True  # a grammar's forced tokens lead the draft (constrain.shape_draft)
    continue_forced: bool = True  # a token-only drafter drafts on after them (drafts_after_forced)


@torch.inference_mode()
def generate(model, job: GenerateJob) -> list[Sequence]:
    seqs = [Sequence(i, list(p), len(p), m, tenant=job.cache_salt) for i, (p, m) in enumerate(zip(job.prompts, job.max_new))]
    if job.params.logprobs is not None:
        for s in seqs:
            s.logprobs, s.top_logprobs = [], job.params.logprobs
    for s in seqs:
        s.penalties = Penalties.of(job.params)
        if job.grammar is not None:
            s.matcher = job.grammar.matcher()
    capacity = max(len(s.tokens) + s.max_new for s in seqs) + _max_draft_nodes(job) + 1
    cache = model.new_cache(len(seqs), capacity)
    generator = make_generator(job.params.seed, model.device)
    drafter = job.drafter if job.k > 0 else None
    if drafter is not None:
        drafter.start(len(seqs), capacity, cache)
    t0 = time.perf_counter()
    starts = [0] * len(seqs)
    if job.prefix is not None:  # K/V of the cached prefix copied in (to the token); prefill computes the rest
        starts = [read_blocks(job.prefix, drafter, s, cache) for s in seqs]
        for s, n in zip(seqs, starts):
            s.stats.cached_tokens = n
    first_tokens(model, cache, seqs, prefill(model, cache, seqs, drafter, starts), job, generator)
    feed_drafter = getattr(drafter, "observe_prompts", None)
    if feed_drafter is not None:  # a draft model's own cache takes the prompts in the prefill too
        feed_drafter([(s.row, s.tokens) for s in seqs], salt=job.cache_salt)  # (the first token pending)
    t_prefill = time.perf_counter() - t0
    active = [s for s in seqs if s.finish_reason is None]
    while active:
        step(model, cache, active, job, generator)
        active = [s for s in active if s.finish_reason is None]
    t_decode = time.perf_counter() - t0 - t_prefill
    retire = getattr(drafter, "retire", None)  # (a draft model keeps its cache's blocks, suffix decoding the output)
    for s in seqs:
        s.stats.prefill_time, s.stats.decode_time = t_prefill, t_decode
        if job.prefix is not None:  # the answer's blocks too: the next turn resends it
            keep_blocks(job.prefix, drafter, s, cache)
        if retire is not None:
            retire(retiring(s))
    return seqs


def read_blocks(prefix: PrefixPool, drafter: Drafter | None, s: Sequence, cache: KVCache) -> int:
    """Copy the cached K/V that start s.tokens into its row (its tenant's); the tokens they
    cover. A drafter that reads the verifier's hidden states gets those of the cached positions
    (HiddenRows from 0): it reads only blocks that keep them."""
    sink = getattr(drafter, "observe_hidden", None)
    on_hidden = None if sink is None else lambda h: sink([HiddenRows(s.row, 0, h)])
    return prefix.read(s.tokens, cache, s.row, s.tenant, on_hidden=on_hidden)


def keep_blocks(prefix: PrefixPool, drafter: Drafter | None, s: Sequence, cache: KVCache) -> None:
    """Store the blocks s's row computed (its prompt and its answer so far); with a drafter that
    reads hidden states, the row's hidden states too (none stored where it lacks some)."""
    n = cache.lengths[s.row]
    if getattr(drafter, "observe_hidden", None) is None:
        prefix.store(s.tokens, cache, s.row, n, s.tenant)
        return
    hidden = getattr(drafter, "hidden_rows", lambda row, n: None)(s.row, n)
    if hidden is not None:
        prefix.store(s.tokens, cache, s.row, n, s.tenant, hidden=hidden)


def _max_draft_nodes(job: GenerateJob) -> int:
    """Cache slots a draft may occupy beyond the committed tokens (a tree can exceed k)."""
    if job.drafter is None or job.k == 0:
        return 0
    return getattr(job.drafter, "max_draft_nodes", lambda k: k)(job.k)


def prefill(model, cache: KVCache, seqs: list[Sequence], drafter: Drafter | None = None,
            starts: list[int] | None = None) -> torch.Tensor:
    """Write K/V for every prompt token from slot starts[i] on (the slots before hold cached K/V;
    a hit leaves at least the last token to compute); a drafter with `observe_hidden` gets the
    hidden states of the tokens computed (HiddenRows). Returns the last prompt token's hidden
    state of each sequence, [B, 1, hidden_size], whose logits give its first token (first_tokens)."""
    starts = starts or [0] * len(seqs)
    last = write_known(model, cache, [PrefixWrite(s.row, a, s.tokens[a:]) for s, a in zip(seqs, starts)], drafter)
    for s in seqs:
        cache.truncate(s.row, len(s.tokens))
    return torch.stack(last)[:, None]


def write_known(model, cache: KVCache, writes: list[PrefixWrite], drafter: Drafter | None = None) -> list[torch.Tensor]:
    """K/V for known tokens (prompts, or chunks of them: the server's chunked prefill); a
    drafter with `observe_hidden` gets their hidden states (HiddenRows). Returns the hidden
    state of each write's last token ([hidden_size] each, in the order of `writes`)."""
    sink = getattr(drafter, "observe_hidden", None)
    last: dict[int, torch.Tensor] = {}

    def on_hidden(p: PrefixWrite, h: torch.Tensor):
        if sink is not None:
            sink([HiddenRows(p.row, p.start, h)])
        last[p.row] = h[-1]  # (a row's chunks run in order: its last chunk comes last)

    write_prefixes(model, cache, writes, on_hidden=on_hidden)
    return [last[w.row] for w in writes]


def first_tokens(model, cache: KVCache, seqs: list[Sequence], hidden: torch.Tensor, job: GenerateJob, generator):
    """Each sequence's first token from its last prompt token's logits (hidden [B, 1,
    hidden_size] from prefill): sampled as a step without a draft samples it (grammar mask,
    penalties, logprobs, the same draws), then committed and streamed. The K/V hold the whole
    prompts, and the new token is pending: the engine's invariant from here on."""
    t0 = time.perf_counter()
    logits = model.hidden_to_logits(hidden)  # [B, 1, V]
    drafts = [Draft([], None) for _ in seqs]
    shaped = _shaped(logits, seqs, drafts)
    nexts = _verify(shaped, drafts, job.params, generator, job.typical).next_token.tolist()
    dt = time.perf_counter() - t0
    for i, (s, nxt) in enumerate(zip(seqs, nexts)):
        s.stats.prefill_tokens += 1
        _commit(s, [nxt], job, cache, draft_s=0.0, verify_s=dt, scored=_scored(s, logits[i], range(1), [nxt]))
        _mark(s, False, 0, at_end=False)


def step(model, cache: KVCache, active: list[Sequence], job: GenerateJob, generator):
    """One verifier forward for every active row: score [pending] + draft, keep n + 1 tokens."""
    t0 = time.perf_counter()
    drafts = _propose(active, job, generator)
    t1 = time.perf_counter()
    if any(d.is_tree for d in drafts):
        return _tree_step(model, cache, active, drafts, job, generator, t0, t1)
    new = [[s.tokens[-1]] + d.tokens for s, d in zip(active, drafts)]
    batch = chain_batch(new, [len(s.tokens) - 1 for s in active], [s.row for s in active], model.device)
    out = model(batch, cache)
    logits = out.logits  # [B, K + 1, V]
    shaped = _shaped(logits, active, drafts)
    result = _verify(shaped, drafts, job.params, generator, job.typical)
    num_accepted, next_tokens = result.num_accepted.tolist(), result.next_token.tolist()  # the one host sync
    paths = [list(range(n)) for n in num_accepted]
    _observe(job, active, drafts, shaped, paths, next_tokens)
    _observe_hidden(job, active, out.hidden, paths)
    _learn(job, active, drafts, num_accepted, t1 - t0)
    t2 = time.perf_counter()
    for i, (s, d, n, nxt) in enumerate(zip(active, drafts, num_accepted, next_tokens)):
        _record(s, d, len(d.tokens), n)
        emitted = d.tokens[:n] + [nxt]
        _commit(s, emitted, job, cache, draft_s=t1 - t0, verify_s=t2 - t1, scored=_scored(s, logits[i], range(n + 1), emitted))
        _mark(s, bool(d.tokens), n, at_end=n == len(d.tokens))


def _tree_step(model, cache, active, drafts, job: GenerateJob, generator, t0: float, t1: float):
    """Score every row's token tree in one forward, keep the accepted path, compact its K/V.

    Node i of a row sits at slot start + 1 + i during the forward; the accepted path is
    then moved to slots start + 1, start + 2, ... so the cache stays a plain chain.
    """
    starts = [len(s.tokens) - 1 for s in active]
    parents = [[-1] + [p + 1 for p in d.parent_list()] for d in drafts]  # node 0 = pending token
    new = [[s.tokens[-1]] + d.tokens for s, d in zip(active, drafts)]
    batch = tree_batch(new, parents, starts, [s.row for s in active], model.device)
    out = model(batch, cache)
    logits = out.logits  # [B, T, V]
    shaped = _shaped(logits, active, drafts)  # (constrained / penalized rows hold chains)
    greedy = job.params.greedy
    target = shaped if greedy else logits_to_probs(shaped, job.params)
    if job.typical is not None and not greedy:
        results = [typical_tree_verify_lossy(d.tokens, d.parent_list(), target[i, : len(d.tokens) + 1], job.typical, generator)
                   for i, d in enumerate(drafts)]
    else:
        results = [tree_verify(d.tokens, d.parent_list(), d.probs, target[i, : len(d.tokens) + 1], greedy, generator)
                   for i, d in enumerate(drafts)]
    _observe(job, active, drafts, shaped, [r.path for r in results], [r.next_token for r in results])
    _observe_hidden(job, active, out.hidden, [r.path for r in results])
    _learn(job, active, drafts, [len(r.path) for r in results], t1 - t0)
    t2 = time.perf_counter()
    for i, (s, d, start, r) in enumerate(zip(active, drafts, starts, results)):
        src = [start + 1 + n for n in r.path]
        dst = list(range(start + 1, start + 1 + len(r.path)))
        if src != dst:
            cache.move(s.row, src, dst)
        _record(s, d, d.depth(), len(r.path), bonus=r.at_leaf and bool(d.tokens))
        emitted = [d.tokens[n] for n in r.path] + [r.next_token]
        rows = [0] + [n + 1 for n in r.path]  # each emitted token was predicted at its parent's row
        _commit(s, emitted, job, cache, draft_s=t1 - t0, verify_s=t2 - t1, scored=_scored(s, logits[i], rows, emitted))
        _mark(s, bool(d.tokens), len(r.path), at_end=r.at_leaf)


def _shaped(logits: torch.Tensor, active: list[Sequence], drafts: list[Draft]) -> torch.Tensor:
    """The logits verification reads: each row's grammar mask, then its logit_bias and penalties,
    at every drafted position; `logits` itself (kept raw for logprobs) when no row has either."""
    masked = mask_logits(logits, [s.matcher for s in active], drafts)
    return penalties.apply(masked, logits, active, drafts)


def _record(s: Sequence, d: Draft, depth: int, accepted: int, bonus: bool | None = None):
    """The step in the row's stats; a grammar's forced tokens apart from the drafter's."""
    kept = min(accepted, d.forced)
    s.stats.forced += kept
    s.stats.record_step(depth - d.forced, accepted - kept, bonus=bonus)


def _mark(s: Sequence, drafted: bool, accepted: int, at_end: bool):
    """Where this step's emitted tokens came from (SpecStats.origins, one letter a token):
    `accepted` draft tokens, then the verifier's own token: bonus when the draft ran out
    (at_end), recovered when a draft token was refused, plain when nothing was drafted."""
    last = "b" if drafted and at_end else "r" if drafted else "p"
    s.stats.origins = (s.stats.origins + "a" * accepted + last)[: len(s.generated)]


def _observe(job: GenerateJob, active, drafts, logits: torch.Tensor, paths: list[list[int]], nexts: list[int]):
    """Give drafters that learn from the verifier (lookahead's Jacobi window) what this
    forward saw: the verifier's argmax at every fed node and the accepted path."""
    observe = getattr(job.drafter, "observe", None)
    if observe is None:
        return
    best = logits.argmax(-1).tolist()  # [B, T]
    feedback = [
        StepFeedback(s.row, len(s.tokens) - 1, d, best[i][: len(d.tokens) + 1], paths[i], nexts[i])
        for i, (s, d) in enumerate(zip(active, drafts))
    ]
    observe(feedback)


def _observe_hidden(job: GenerateJob, active, hidden: torch.Tensor, paths: list[list[int]]):
    """Give drafters that read the verifier's hidden states (Medusa, EAGLE) the rows of this
    forward that are now committed: the pending token (fed node 0) and the accepted path
    (draft node n was fed as node n + 1). hidden: [B, T, hidden_size]."""
    observe = getattr(job.drafter, "observe_hidden", None)
    if observe is None:
        return
    rows = []
    for i, (s, path) in enumerate(zip(active, paths)):
        fed = [0] + [n + 1 for n in path]
        h = hidden[i, : len(fed)] if fed == list(range(len(fed))) else hidden[i, torch.tensor(fed, device=hidden.device)]
        rows.append(HiddenRows(s.row, len(s.tokens) - 1, h))
    observe(rows)


def _propose(active: list[Sequence], job: GenerateJob, generator) -> list[Draft]:
    if job.drafter is None or job.k == 0:
        return [Draft([], None) for _ in active]
    # Never draft past the sequence's budget: a step emits up to k + 1 tokens.
    k = [job.k_policy.k_for(s.row) if job.k_policy is not None else job.k for s in active]
    requests = [DraftRequest(s.row, s.tokens, max(0, min(kb, s.remaining - 1)), s.prompt_len, s.tenant)
                for s, kb in zip(active, k)]
    runs = [forced_run(s.matcher, r.k, job.forced_drafts) for s, r in zip(active, requests)]
    # A drafter that drafts from tokens alone continues after the grammar's forced run (it will
    # be committed: p = 1), where the budget left after the run is its to fill.
    after = job.continue_forced and bool(getattr(job.drafter, "drafts_after_forced", False))
    asked = [replace(r, tokens=r.tokens + run, k=r.k - len(run)) if after and run else r for r, run in zip(requests, runs)]
    drafts = job.drafter.propose(asked, job.params, generator)
    drafts = [first_branch(d) if d.is_tree and s.penalties is not None else d for s, d in zip(active, drafts)]
    return [d if s.matcher is None else shape_draft(s.matcher, d, r.k, run, after)
            for s, d, r, run in zip(active, drafts, requests, runs)]


def retiring(s: Sequence) -> DraftRequest:
    """What a drafter's `retire` gets when `s` ends: its row and tokens, no draft wanted."""
    return DraftRequest(s.row, s.tokens, 0, s.prompt_len, s.tenant)


def _learn(job: GenerateJob, active: list[Sequence], drafts: list[Draft], accepted: list[int], draft_s: float):
    """Feed the adaptive-k policy what this step showed: acceptance per row, drafter time."""
    policy = job.k_policy
    if policy is None:
        return
    for s, d, n in zip(active, drafts, accepted):
        policy.update(s.row, d.depth() if d.is_tree else len(d.tokens), n)
    drafted = sum(len(d.tokens) for d in drafts)
    if drafted:
        policy.observe_draft_time(draft_s / drafted)


def _verify(logits: torch.Tensor, drafts: list[Draft], params: SamplingParams, generator, typical: TypicalRule | None = None):
    """Pad the drafts to [B, K] and run greedy, rejection or (opted into) typical verification on the batch."""
    B, T, V = logits.shape
    K, dev = T - 1, logits.device
    padded = [d.tokens + [0] * (K - len(d.tokens)) for d in drafts]  # built on the host: one copy
    tokens = torch.tensor(padded, dtype=torch.long, device=dev).view(B, K)
    lens = torch.tensor([len(d.tokens) for d in drafts], device=dev)
    if params.greedy:
        return greedy_verify(tokens, lens, logits)
    if typical is not None:
        return typical_verify_lossy(tokens, lens, logits_to_probs(logits, params), typical, generator)
    q = None
    if any(d.probs is not None for d in drafts):
        q = torch.zeros(B, K, V, dtype=logits.dtype if logits.dtype == torch.float64 else torch.float32, device=dev)
        for i, d in enumerate(drafts):
            if d.probs is not None and len(d.tokens):
                q[i, : len(d.tokens)] = d.probs
            elif len(d.tokens):  # a one-hot proposal inside a probabilistic batch
                q[i, : len(d.tokens)] = torch.nn.functional.one_hot(tokens[i, : len(d.tokens)], V).to(q.dtype)
    return rejection_verify(tokens, lens, q, logits_to_probs(logits, params), generator)


def _scored(s: Sequence, logits: torch.Tensor, rows, emitted: list[int]) -> list | None:
    """The emitted tokens' logprobs (logits [T, V] of the row's forward; rows[j]: the position
    that predicted emitted[j]) when the sequence keeps them; nothing is computed (or copied)
    otherwise."""
    if s.top_logprobs is None:
        return None
    return sequence_logprobs(logits, emitted, s.top_logprobs, rows)


def _commit(s: Sequence, emitted: list[int], job: GenerateJob, cache: KVCache, draft_s: float, verify_s: float,
            scored: list | None = None):
    """Append emitted tokens one by one until EOS, a stop string or the token budget (and
    their logprobs, `scored`, when kept); charge the step's drafting and verification time
    (shared by the batch) to the row."""
    s.stats.draft_time += draft_s
    s.stats.verify_time += verify_s
    for j, tok in enumerate(emitted):
        s.tokens.append(tok)
        if scored is not None:
            s.logprobs.append(scored[j])
        if tok in job.eos_ids and not job.params.ignore_eos:
            s.finish_reason = "stop"
        elif s.matcher is not None and follow(s.matcher, tok):  # the grammar is complete
            s.finish_reason = "stop"
        elif job.should_stop is not None and job.should_stop(s.row, s.generated):
            s.finish_reason = "stop"
        elif s.remaining <= 0:
            s.finish_reason = "length"
        if s.finish_reason:
            break
    s.stats.generated = len(s.generated)
    cache.truncate(s.row, len(s.tokens) - 1)
    if job.on_tokens is not None:
        job.on_tokens(s.row, s.generated, s.finish_reason is not None)
