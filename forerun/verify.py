"""Verification: which drafted tokens the verifier keeps, and the token that follows.

Vocabulary, used everywhere in forerun:
  output tokens of a step = accepted + (recovered | bonus)
  - accepted:  the longest draft prefix the verifier keeps (n of the k drafted);
  - recovered: on a rejection at position n, a token drawn from norm(max(0, p_n - q_n));
  - bonus:     when all k are accepted, a token drawn from p_k (the position after the draft).
So every verifier forward emits n + 1 tokens, 1 <= n + 1 <= k + 1.

All of it is exact (the output law is the verifier's) except what is named `*_lossy`:
Medusa's typical acceptance, an explicit opt-in (SpeculativeConfig(acceptance="typical_lossy")).

Pure functions over padded batches: row b drafted draft_lens[b] <= K tokens; entries
past that are padding and never accepted. No host sync inside: the engine reads
`num_accepted` and `next_token` once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.config import TypicalRule
from forerun.sampling import argmax, sample


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per row
    next_token: torch.Tensor  # [B] int64, the recovered or bonus token per row


def _accepted_prefix(ok: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """ok [B, K] bool -> [B] length of the leading run of True within each row's draft."""
    K = ok.shape[1]
    valid = torch.arange(K, device=ok.device)[None, :] < draft_lens[:, None]
    return (ok & valid).long().cumprod(dim=1).sum(dim=1)


def greedy_verify(draft_tokens: torch.Tensor, draft_lens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Keep drafts while they equal the verifier's argmax; then emit the argmax.

    draft_tokens [B, K]; draft_lens [B]; target_logits [B, K + 1, V].
    >>> logits = torch.eye(4)[[1, 2, 3]][None]  # verifier argmax: 1, 2, 3
    >>> r = greedy_verify(torch.tensor([[1, 0]]), torch.tensor([2]), logits)
    >>> r.num_accepted.tolist(), r.next_token.tolist()
    ([1], [2])
    """
    best = argmax(target_logits)  # [B, K + 1]
    n = _accepted_prefix(draft_tokens == best[:, :-1], draft_lens)
    return VerifyResult(n, best.gather(1, n[:, None]).squeeze(1))


def rejection_verify(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_lens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, K, V] q of each drafted position; None = one-hot drafts
    target_probs: torch.Tensor,  # [B, K + 1, V] p, shaped by the same SamplingParams as plain sampling
    generator: torch.Generator | None,
) -> VerifyResult:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw
    from norm(max(0, p_i - q_i)); if all are accepted draw the bonus from p_K. A one-hot
    q (n-gram, any deterministic proposal) gives accept prob p_i(x_i) and residual p_i
    with x_i removed. The emitted tokens are then distributed exactly as plain sampling.
    """
    B, K = draft_tokens.shape
    dt = target_probs.dtype
    p_draft = target_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.to(dt).gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(B, K, generator=generator, device=target_probs.device, dtype=dt)
    n = _accepted_prefix(u * q_draft < p_draft, draft_lens)  # u < p/q without dividing by q
    p_next = target_probs.gather(1, n[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)  # [B, V]
    rejected = (n < draft_lens)[:, None]
    q_next = _q_at(draft_tokens, draft_probs, n, target_probs.shape[-1], dt)  # [B, V]
    residual = torch.where(rejected, (p_next - q_next).clamp_min(0), p_next)
    # p == q exactly leaves no residual mass; that rejection has probability 0 and only
    # float rounding reaches it: fall back to p rather than divide by zero.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    return VerifyResult(n, sample(residual / residual.sum(-1, keepdim=True), generator))


def _q_at(draft_tokens, draft_probs, n, vocab: int, dt) -> torch.Tensor:
    """[B, V]: the drafter's q at position n of each row (zeros where n == K, the bonus)."""
    B, K = draft_tokens.shape
    if K == 0:
        return torch.zeros(B, vocab, dtype=dt, device=draft_tokens.device)
    idx = n.clamp(max=K - 1)
    in_draft = (n < K)[:, None].to(dt)
    if draft_probs is None:
        tok = draft_tokens.gather(1, idx[:, None]).squeeze(1)
        q = torch.nn.functional.one_hot(tok, vocab).to(dt)
    else:
        q = draft_probs.to(dt).gather(1, idx[:, None, None].expand(-1, 1, vocab)).squeeze(1)
    return q * in_draft


@dataclass
class TreeResult:
    path: list[int]  # accepted node indices, root to leaf (node i = draft token i)
    next_token: int  # recovered token, or bonus when the walk ended at a leaf
    at_leaf: bool  # True: every candidate on the path was accepted down to a leaf (bonus)


def tree_verify(
    tokens: list[int],  # [n] draft tokens, parents before children
    parents: list[int],  # [n] parent index, -1 = the pending token
    draft_probs: torch.Tensor | None,  # [n, V] q each node was drawn from; None = deterministic
    target: torch.Tensor,  # [n + 1, V]: row 0 at the pending token, row i + 1 at node i
    greedy: bool,  # target holds logits (argmax walk) instead of probabilities
    generator: torch.Generator | None,
) -> TreeResult:
    """Walk the tree from the pending token, accepting at most one child per level.

    Greedy: follow the child equal to the verifier's argmax. Sampling, per Draft's rule:
      deterministic siblings x1..xm (one-hot q): accept x_j with prob r(x_j), else
        r <- norm(r with x_j removed); this is sampling r by inspection, hence exact;
      independent siblings drawn from q (SpecInfer's recursive rejection sampling):
        accept x_j with prob min(1, r(x_j)/q(x_j)), else r <- norm(max(0, r - q)).
    r starts as p at the node; when every child is rejected, draw from the final r.
    Per-node control flow: cheap on the CPU; on an accelerator each decision is a sync.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path, node = [], -1
    while True:
        kids = children.get(node, [])
        row = target[node + 1]
        if greedy:
            best = int(row.argmax())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return TreeResult(path, best, not kids)
        else:
            nxt, residual = _pick_child(kids, tokens, draft_probs, row, generator)
            if nxt is None:
                return TreeResult(path, int(sample(residual[None], generator)[0]), not kids)
        path.append(nxt)
        node = nxt


def _pick_child(kids, tokens, draft_probs, p: torch.Tensor, generator):
    """One level of the walk: (accepted child, None) or (None, residual to sample from)."""
    r = p / p.sum()
    for c in kids:
        x = tokens[c]
        q = None if draft_probs is None else draft_probs[c].to(r.dtype)
        u = float(torch.rand((), generator=generator, dtype=torch.float64, device=r.device))
        q_x = 1.0 if q is None else float(q[x])
        if u * q_x < float(r[x]):
            return c, None
        nxt = r.clone()
        if q is None:
            nxt[x] = 0.0
        else:
            nxt = (nxt - q).clamp_min(0)
        if float(nxt.sum()) <= 0:  # only reachable by float rounding (see rejection_verify)
            nxt = r
        r = nxt / nxt.sum()
    return None, r


def typical_threshold(probs: torch.Tensor, rule: TypicalRule) -> torch.Tensor:
    """probs [..., V] -> [...]: min(epsilon, alpha * exp(-H(p))).
    >>> round(float(typical_threshold(torch.tensor([0.5, 0.5]), TypicalRule(0.9, 1.0))), 4)  # exp(-log 2)
    0.5
    """
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.clamp(rule.alpha * torch.exp(-entropy), max=rule.epsilon)


def typical_verify_lossy(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_lens: torch.Tensor,  # [B]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    rule: TypicalRule,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Keep the longest prefix of typical drafted tokens, then draw the next token from p.
    >>> p = torch.tensor([[[0.7, 0.3], [0.5, 0.5], [1.0, 0.0]]])
    >>> typical_verify_lossy(torch.tensor([[1, 1]]), torch.tensor([2]), p, TypicalRule(0.2, 1.0), None).num_accepted.tolist()
    [2]
    """
    K = draft_tokens.shape[1]
    p_draft = target_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    n = _accepted_prefix(p_draft > typical_threshold(target_probs[:, :K], rule), draft_lens)
    p_next = target_probs.gather(1, n[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)  # [B, V]
    return VerifyResult(n, sample(p_next, generator))


def typical_tree_verify_lossy(
    tokens: list[int], parents: list[int], target: torch.Tensor, rule: TypicalRule, generator: torch.Generator | None
) -> TreeResult:
    """tree_verify's walk under typical acceptance (LOSSY): at each level follow the most
    probable typical child; where none is typical, draw from p at that node. target [n + 1, V]
    probabilities (row 0: the pending token, row i + 1: node i)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path, node = [], -1
    while True:
        kids, row = children.get(node, []), target[node + 1]
        bar = float(typical_threshold(row, rule))
        typical = [c for c in kids if float(row[tokens[c]]) > bar]
        if not typical:
            return TreeResult(path, int(sample(row[None], generator)[0]), not kids)
        node = max(typical, key=lambda c: float(row[tokens[c]]))
        path.append(node)
