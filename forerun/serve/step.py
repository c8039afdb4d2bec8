"""One scheduler step: every running row advances by one verifier forward (and a newcomer's
first token, sampled from its prefill's last logits, goes through the same groups).

Rows are grouped by how they verify (greedy; the same sampling rule; a seeded request
alone, with its own generator) and each group is one `engine.step`: one batched forward in
which every row drafts and accepts its own number of tokens. Greedy requests, whatever
their max_tokens or stop strings, always share one forward. k per row is
min(the request's k, the batch-aware k for the current batch size).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forerun import engine
from forerun.sampling import make_generator
from forerun.kv.blocks import BlockTable
from forerun.serve.request import Event, ServeRequest
from forerun.streaming import TextStream, hits_stop


@dataclass
class Live:
    req: ServeRequest
    seq: engine.Sequence  # seq.row is the cache row
    table: BlockTable
    stream: TextStream
    t_admit: float  # perf_counter at admission
    generator: torch.Generator | None = None  # seeded sampling only
    logprobs_sent: int = 0  # seq.logprobs already handed to the consumer
    piece: object = None  # token id -> its text (Logprob.decoded_token), when logprobs are kept
    order: int = 0  # admission order (the newest sequence is preempted first)
    preempted: int = 0  # times it gave its row and blocks back and waited


@dataclass
class RowK:
    """A k_policy for engine.step: this step's k per row, fixed by the scheduler."""

    ks: dict[int, int] = field(default_factory=dict)  # row -> k

    def k_for(self, row: int) -> int:
        return self.ks[row]

    def update(self, row: int, drafted: int, accepted: int) -> None:
        pass

    def observe_draft_time(self, seconds_per_token: float) -> None:
        pass


def group_key(lv: Live) -> tuple:
    p = lv.req.params
    if p.greedy:
        return ("greedy", p.ignore_eos)
    if p.seed is not None:
        return ("seeded", lv.req.id)
    return ("sampled", p.temperature, p.top_p, p.top_k, p.ignore_eos)


def step_all(sched, lives: list[Live]) -> tuple[int, int, int | None]:
    """Advance every live row once; returns (tokens drafted, tokens accepted, the batch's k
    when the batch-aware choice was what bounded it, else None) for this step."""
    ks, k_cap = _plan_k(sched, lives)
    before = {lv.seq.row: (lv.seq.stats.drafted, lv.seq.stats.accepted) for lv in lives}
    _each_group(sched, [lv for lv in lives if lv.seq.row in ks],
                lambda group: _step_group(sched, group, RowK({lv.seq.row: ks[lv.seq.row] for lv in group})))
    drafted = sum(lv.seq.stats.drafted - before[lv.seq.row][0] for lv in lives)
    accepted = sum(lv.seq.stats.accepted - before[lv.seq.row][1] for lv in lives)
    chosen = k_cap if ks and max(ks.values()) == k_cap else None  # not a request's own cap
    return drafted, accepted, chosen


def _plan_k(sched, lives: list[Live]) -> tuple[dict[int, int], int]:
    """k per row for this step (and the batch's cap), with KV blocks reserved for what the
    step may write (its next token and its draft), oldest row first: a row short of blocks has
    the newest sequence preempted (itself, when it is the newest) until they are free; only a
    row alone in a pool too small for it fails."""
    k_cap = max((lv.req.k for lv in lives), default=0) if sched.drafter is not None else 0
    if k_cap and sched.batch_k is not None:
        k_cap = min(k_cap, sched.batch_k.choose(len(lives), **switch_terms(sched.drafter, lives)))
    nodes = getattr(sched.drafter, "max_draft_nodes", lambda k: k)
    ks = {}
    for lv in sorted(lives, key=lambda lv: lv.order):
        if sched.running.get(lv.seq.row) is not lv:  # preempted for an older row this step
            continue
        k = min(lv.req.k, k_cap)
        need = len(lv.seq.tokens) + (nodes(k) if k else 0)
        held = len(lv.table.blocks)
        # (room for the draft too: drafting 0 instead would change the draws of a seeded row)
        room = lv.table.ensure(need)
        while not room and sched.preempt_newest(lv) and sched.running.get(lv.seq.row) is lv:
            room = lv.table.ensure(need)
        if sched.running.get(lv.seq.row) is not lv:
            continue  # it was the newest: it waits
        if not room:
            sched._finish(lv, Event(error="KV cache blocks exhausted"))
            continue
        if len(lv.table.blocks) != held:
            sched.sync_table(lv.seq.row, lv.table.blocks)
        ks[lv.seq.row] = k
    return ks, k_cap


def switch_terms(drafter, lives: list[Live]) -> dict:
    """For batch-aware k: what drafting this step would first cost (the tokens the draft model
    has not seen, at its measured seconds per fed token) and the tokens the rows may still emit."""
    unfed, fed = getattr(drafter, "unfed", None), getattr(drafter, "fed_tokens", 0)
    if unfed is None or not fed:
        return {}
    per_token = (drafter.catch_up_seconds + drafter.prompt_seconds) / fed
    tokens = sum(unfed(lv.seq.row, lv.seq.tokens) for lv in lives)
    return {"switch_cost": tokens * per_token, "remaining": sum(lv.seq.remaining for lv in lives)}


def first_tokens(sched, lives: list[Live], hidden: dict[int, torch.Tensor]) -> None:
    """Each newcomer's first token from its last prompt token's logits (hidden: row -> that
    token's hidden state, [hidden_size], from the prefill), sampled group by group as a step
    without a draft samples it (engine.first_tokens)."""

    def first(group: list[Live]) -> None:
        job, generator = _group_job(sched, group, RowK({lv.seq.row: 0 for lv in group}))
        with torch.inference_mode():
            rows = torch.stack([hidden[lv.seq.row] for lv in group])[:, None]
            engine.first_tokens(sched.model, sched.cache, [lv.seq for lv in group], rows, job, generator)

    _each_group(sched, lives, first)


def _each_group(sched, lives: list[Live], run) -> None:
    """run(group) for each sampling group of `lives` (group_key); an exception fails that
    group's requests only, and the other rows are untouched."""
    groups: dict[tuple, list[Live]] = {}
    for lv in lives:
        groups.setdefault(group_key(lv), []).append(lv)
    for group in groups.values():
        try:
            run(group)
        except Exception as exc:
            for lv in group:
                sched._finish(lv, Event(error=f"{type(exc).__name__}: {exc}"))


def _step_group(sched, group: list[Live], row_k: RowK) -> None:
    job, generator = _group_job(sched, group, row_k)
    with torch.inference_mode():
        engine.step(sched.model, sched.cache, [lv.seq for lv in group], job, generator)


def _group_job(sched, group: list[Live], row_k: RowK) -> tuple[engine.GenerateJob, torch.Generator | None]:
    """The engine job of one sampling group (its stops and stream, k per row) and its generator
    (a seeded request's own, made on its first use)."""
    params = group[0].req.params
    by_row = {lv.seq.row: lv for lv in group}
    k = max(row_k.ks.values())
    job = engine.GenerateJob(
        [], params, [], drafter=sched.drafter if k else None, k=k, eos_ids=sched.eos_ids,
        should_stop=lambda row, gen: _stopped(sched, by_row[row], gen),
        on_tokens=lambda row, gen, done: by_row[row].stream.update(0, gen, done),
        k_policy=row_k, forced_drafts=sched.forced_drafts, continue_forced=sched.continue_forced,
    )
    generator = group[0].generator if params.seed is not None else sched.generator
    if params.seed is not None and generator is None:
        generator = group[0].generator = make_generator(params.seed, sched.model.device)
    return job, generator


def _stopped(sched, lv: Live, generated: list[int]) -> bool:
    return hits_stop(sched.llm.decode, generated, lv.req.params.stop)

