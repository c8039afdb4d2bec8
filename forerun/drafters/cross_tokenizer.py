"""A draft model whose tokenizer differs from the verifier's (e.g. SmolLM2 for Gemma 3).

The draft reads the committed text re-tokenised in its own vocabulary and keeps its own
KV cache, re-synced by longest common prefix. Its proposals become verifier tokens in
one of two ways, chosen by what keeps verification exact:
  greedy   -> text re-tokenisation: decode the drafted draft tokens to text, encode that
              text with the verifier's tokenizer. Any proposal is fine for greedy
              verification (deterministic, one-hot q), so nothing is lost.
  sampling -> vocabulary intersection: the draft's q restricted to tokens whose text both
              vocabularies share, renormalised and written in verifier ids. Each drafted
              token is drawn from exactly that q, so rejection sampling stays exact; the
              draft then continues by feeding the same string in its own vocabulary.
"""
from __future__ import annotations

import torch

from forerun.config import SamplingParams
from forerun.drafters.base import Draft, DraftRequest
from forerun.errors import ConfigError
from forerun.kv.cache import KVCache, chain_batch
from forerun.prefill import feed_all_but_last
from forerun.sampling import logits_to_probs, sample


def shared_vocabulary(verifier_tok, draft_tok) -> tuple[torch.Tensor, torch.Tensor]:
    """(verifier ids, draft ids) of the tokens whose text is identical in both."""
    by_text = {t: i for i, t in enumerate(draft_tok.token_texts()) if t is not None}
    pairs = [(v, by_text[t]) for v, t in enumerate(verifier_tok.token_texts()) if t is not None and t in by_text]
    if not pairs:
        raise ConfigError("the draft and verifier vocabularies share no token text; cross-tokenizer drafting cannot work")
    v_ids, d_ids = zip(*pairs)
    return torch.tensor(v_ids), torch.tensor(d_ids)


class CrossTokenizerDrafter:
    name = "draft_model"

    def __init__(self, draft_model, draft_tok, verifier_tok, verifier_vocab: int):
        self.model, self.dtok, self.vtok, self.vocab = draft_model, draft_tok, verifier_tok, verifier_vocab
        self._shared = None  # (verifier ids, draft ids), built on first sampled step
        self.cache: KVCache | None = None
        self.fed: dict[int, list[int]] = {}  # row -> draft ids whose K/V sit in the draft cache

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        # Draft tokenisations run longer than the verifier's when its vocabulary is smaller.
        self.capacity = 4 * capacity + 64
        self.cache = self.model.new_cache(num_rows, self.capacity)
        self.fed = {}

    def release(self, row: int) -> None:
        """A new sequence takes this row (the server's continuous batching)."""
        self.fed.pop(row, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], params: SamplingParams, generator) -> list[Draft]:
        ctx = {r.row: self.dtok.encode(self.vtok.decode(r.tokens)) for r in requests if r.k > 0}
        live = [r for r in requests if r.k > 0 and len(ctx[r.row]) + r.k < self.capacity and ctx[r.row]]
        drafted = self._run(live, ctx, params, generator)
        out = []
        for r in requests:
            toks, q = drafted.get(r.row, ([], []))
            if params.greedy:
                out.append(Draft(self._retokenize(ctx[r.row], toks)[: r.k]) if toks else Draft([]))
            else:
                out.append(Draft.of(toks, q) if toks else Draft([]))
        return out

    def _run(self, live, ctx, params, generator) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        """Draft up to r.k tokens per row; sampling stops a row when q has no shared mass."""
        out = {r.row: ([], []) for r in live}
        feeds = [self._catch_up(r.row, ctx[r.row]) for r in live]
        for r, (start, f) in zip(live, feeds):  # the bulk is written below, before the loop
            self.fed[r.row] = self.fed[r.row][:start] + f[:-1]
        starts, new = feed_all_but_last(self.model, self.cache, [r.row for r in live], feeds)
        for step in range(max((r.k for r in live), default=0)):
            if not live:
                break
            batch = chain_batch(new, starts, [r.row for r in live], self.model.device)  # one token per row
            logits = self.model(batch, self.cache).logits[:, 0]  # [B, V_draft]
            for r, s, f in zip(live, starts, new):
                self.fed[r.row] = self.fed[r.row][:s] + f
            picked, feed_ids = self._pick(logits, params, generator)
            keep = []
            for i, r in enumerate(live):
                if picked[i] is None:
                    continue
                out[r.row][0].append(picked[i][0])
                if picked[i][1] is not None:
                    out[r.row][1].append(picked[i][1])
                if r.k > step + 1:
                    keep.append(i)
            starts = [starts[i] + len(new[i]) for i in keep]
            new, live = [[feed_ids[i]] for i in keep], [live[i] for i in keep]
        return out

    def _catch_up(self, row: int, ids: list[int]) -> tuple[int, list[int]]:
        fed = self.fed.setdefault(row, [])
        n = 0
        while n < min(len(fed), len(ids) - 1) and fed[n] == ids[n]:
            n += 1
        return n, ids[n:]

    def _pick(self, logits, params: SamplingParams, generator):
        """Per row: ((token to propose, its q row or None), draft id to feed next)."""
        if params.greedy:
            ids = logits.argmax(-1).tolist()
            return [(i, None) for i in ids], ids
        if self._shared is None:
            self._shared = tuple(t.to(logits.device) for t in shared_vocabulary(self.vtok, self.dtok))
        v_ids, d_ids = self._shared
        q_draft = logits_to_probs(logits, params)[:, d_ids]  # [B, shared]
        mass = q_draft.sum(-1, keepdim=True)
        q = torch.zeros(logits.shape[0], self.vocab, dtype=q_draft.dtype, device=logits.device)
        q[:, v_ids] = q_draft / mass.clamp_min(1e-30)  # [B, V_verifier]
        j = sample(q[:, v_ids] + (mass <= 0).to(q.dtype), generator)  # index into the shared list
        has_mass = (mass[:, 0] > 0).tolist()
        v, d = v_ids[j].tolist(), d_ids[j].tolist()
        return [((v[i], q[i]) if has_mass[i] else None) for i in range(len(v))], d

    def _retokenize(self, ctx: list[int], drafted: list[int]) -> list[int]:
        """Draft ids -> the continuation's text -> verifier ids."""
        base = self.dtok.decode(ctx)
        full = self.dtok.decode(ctx + drafted)
        text = full[len(base):] if full.startswith(base) else self.dtok.decode(drafted)
        return self.vtok.encode(text, add_special_tokens=False) if text else []
