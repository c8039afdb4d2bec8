"""The engine hands drafters the verifier's hidden states of every committed token.

Before each `propose`, a drafter with `observe_hidden` must hold, for each row, hidden
states for positions 0 .. len(tokens) - 2 equal to a fresh teacher-forced forward over the
committed tokens: after prefill, after chain steps and after tree steps (whose accepted
path is not the first nodes), greedy and sampled.
"""
import random

import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters.base import Draft, HiddenRows
from forerun.engine import GenerateJob, generate
from forerun.kv.cache import chain_batch
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 6], [7], [3, 3, 9, 1]]


class Recorder:
    """Drafts the verifier's greedy continuation with one token corrupted at a random
    place (so acceptance lengths vary); as a tree, a wrong sibling is placed first."""

    name = "recorder"

    def __init__(self, model, tree: bool):
        self.model, self.tree, self.rng = model, tree, random.Random(0)
        self.seen: dict[int, dict[int, torch.Tensor]] = {}
        self.checks = 0

    def start(self, num_rows, capacity, verifier_cache):
        self.seen = {}

    def observe_hidden(self, rows: list[HiddenRows]):
        for r in rows:
            for i in range(r.hidden.shape[0]):
                self.seen.setdefault(r.row, {})[r.start + i] = r.hidden[i].clone()

    def max_draft_nodes(self, k):
        return k + 1

    def propose(self, requests, params, generator):
        out = []
        for r in requests:
            self._check(r.row, r.tokens)
            out.append(self._draft(r.tokens, r.k))
        return out

    def _check(self, row, tokens):
        if len(tokens) < 2:
            return
        want = self._hidden(tokens[:-1])  # [N - 1, H]
        got = torch.stack([self.seen[row][p] for p in range(len(tokens) - 1)])
        torch.testing.assert_close(got, want)
        self.checks += 1

    def _hidden(self, ids):
        batch = chain_batch([ids], [0], [0], self.model.device)
        return self.model(batch, self.model.new_cache(1, len(ids)), logits_at=None).hidden[0]

    def _draft(self, tokens, k):
        if k == 0:
            return Draft([])
        seq = list(tokens)
        for _ in range(k):
            seq.append(int(self.model.score(seq, last_only=True).argmax()))
        good = seq[len(tokens):]
        bad_at = self.rng.randrange(k + 1)
        chain = [t if i != bad_at else (t + 1) % 32 for i, t in enumerate(good)]
        if not self.tree:
            return Draft(chain)
        wrong = (good[0] + 2) % 32
        # node 0: a wrong first token; nodes 1..k: the chain, hanging off the pending token
        return Draft([wrong] + chain, None, [-1, -1] + list(range(1, k)))


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_hidden_rows_cover_every_committed_token(tree, temperature):
    model = tiny_model(seed=0)
    rec = Recorder(model, tree)
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5)
    job = GenerateJob(PROMPTS, params, [24] * len(PROMPTS), drafter=rec, k=3)
    with torch.inference_mode():
        seqs = generate(model, job)
    assert all(len(s.generated) == 24 for s in seqs)
    assert rec.checks >= 20
    assert sum(s.stats.accepted for s in seqs) > 0  # accepted paths were exercised


def test_drafters_without_the_hook_get_nothing_and_work():
    """ngram has no observe_hidden: the engine must not call one (plain contract unchanged)."""
    from forerun.llm import LLM

    llm = LLM(tiny_model(seed=0))
    greedy = SamplingParams(temperature=0, max_tokens=16)
    plain = llm.generate(PROMPTS, greedy, speculative=None)
    spec = llm.generate(PROMPTS, greedy, speculative=SpeculativeConfig("ngram", 3))
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
