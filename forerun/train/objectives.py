"""Training losses and held-out accuracies for the heads (pure functions of tensors).

Targets are the verifier's own next-token distributions, p_m = softmax(lm_head(h_m)) for
chunk position m (the law of token m + 1), so a head learns what the verifier would say,
not what the text says. With a chunk of T tokens and its hidden states h [B, T, H]:
  Medusa head i at position t predicts token t + 2 + i: target p_{t+1+i}, t = 0 .. T-2-i.
  EAGLE pair j = (h_j, x_{j+1}), j = 0 .. T-2, guesses h_{j+1}: smooth-L1 to h_{j+1} plus
        0.1 x cross-entropy of lm_head(guess) against p_{j+1} (EAGLE's weighting).
  DFlash anchor P (every DFLASH_STRIDE-th position with a whole block after it) reads the
        pairs (h_t, x_{t+1}), t = P - C .. P - 1, and guesses h_{P+i-1} at block position
        i = 1 .. block (the law of x_{P+i}): EAGLE's loss per position, averaged.
Accuracy is top-1 agreement with the verifier (argmax of the head's distribution ==
argmax of p): the chance a greedy draft token is accepted, teacher-forced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forerun.kv.cache import ForwardBatch, chain_batch

EAGLE_CE_WEIGHT = 0.1
DFLASH_STRIDE = 3  # anchors per chunk: every third position (neighbours share most of their context)


@dataclass
class Objective:
    loss: torch.Tensor  # scalar, differentiable in the head's parameters
    accuracy: list[float]  # top-1 agreement: per Medusa head, or [EAGLE's next-token guess]
    # Medusa / block heads: positions 1..i all agree (a chain's acceptance needs that; accuracy[i]
    # counts position i alone, and a block head's positions agree on different tokens' drafts)
    joint: list[float] | None = None


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_v p(v) log q(v); [..., V] each (equal to KL(p || q) + H(p)).
    >>> z = torch.tensor([[0.0, 0.0]])
    >>> round(float(soft_cross_entropy(z, torch.log_softmax(z, -1))), 4)  # log 2
    0.6931
    """
    return -(teacher_logp.exp() * torch.log_softmax(student_logits, dim=-1)).sum(-1).mean()


def agreement(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> float:
    return float(hits(student_logits, teacher_logits).float().mean())


def hits(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return student_logits.argmax(-1) == teacher_logits.argmax(-1)


def joint_agreement(per_position: list[torch.Tensor]) -> list[float]:
    """per_position[i]: bool hits [B, n_i] of position i at draft starts 0..n_i - 1 -> per i,
    the share of the starts every position has (the first min n_i) where positions 0..i all
    agree (non-increasing in i).
    >>> joint_agreement([torch.tensor([[True, True, False]]), torch.tensor([[True, False]])])
    [1.0, 0.5]
    """
    n = min(h.shape[1] for h in per_position)
    run = torch.ones_like(per_position[0][:, :n])
    out = []
    for h in per_position:
        run = run & h[:, :n]
        out.append(float(run.float().mean()))
    return out


def by_position(loss: torch.Tensor, per_position: list[torch.Tensor]) -> Objective:
    """Medusa's and the block head's Objective from each position's bool hits [B, n_i]: the
    agreement at each position alone and the joint agreement."""
    return Objective(loss, [float(h.float().mean()) for h in per_position], joint_agreement(per_position))


def medusa_objective(heads, lm_head, hidden: torch.Tensor) -> Objective:
    """hidden [B, T, H] float32 (frozen verifier states) -> loss averaged over the K heads."""
    T, K = hidden.shape[1], heads.config.num_heads
    with torch.no_grad():
        teacher = torch.log_softmax(lm_head(hidden[:, 1:]), dim=-1)  # [B, T-1, V]: p_1 .. p_{T-1}
    feats = heads(hidden[:, : T - 1])  # [B, T-1, K, H]
    loss, per = hidden.new_zeros(()), []
    for i in range(min(K, T - 1)):
        n = T - 1 - i  # positions t = 0 .. T-2-i; target p_{t+1+i} = teacher[:, t + i]
        student = lm_head(feats[:, :n, i])
        loss = loss + soft_cross_entropy(student, teacher[:, i : i + n])
        per.append(hits(student, teacher[:, i : i + n]))
    return by_position(loss / K, per)


def eagle_objective(head, embed, lm_head, hidden: torch.Tensor, tokens: torch.Tensor, unroll: int = 1) -> Objective:
    """hidden [B, T, H] float32, tokens [B, T] -> EAGLE's loss over the T - 1 pairs, averaged
    over `unroll` steps; accuracy per step.

    Step 1 is teacher-forced: pair j = (h_j, x_{j+1}) guesses g1_{j+1}. Step s > 1 is the
    training-time test of EAGLE-3: the pair (g_{s-1} for h_{j+s-1}, x_{j+s}) at position
    j + s - 1 guesses h_{j+s}, attending to the true pairs 0..j and to its own column's
    earlier guesses only, as drafting does (true pairs up to the last verified token, then
    the head's own guesses), so the head learns to continue from its own guesses."""
    B, T, _ = hidden.shape
    n = T - 1
    batch = chain_batch(tokens[:, 1:].tolist(), [0] * B, list(range(B)), hidden.device)  # pair j at position j
    cache = head.new_cache(B, n)
    guess = head(hidden[:, :-1], embed(batch.tokens).to(hidden.dtype), batch, cache)  # [B, n, H]
    with torch.no_grad():
        teacher = torch.log_softmax(lm_head(hidden[:, 1:]), dim=-1)  # [B, n, V]: p_{j+1}
    loss, acc = hidden.new_zeros(()), []
    for s in range(1, min(unroll, n) + 1):
        if s > 1:
            guess, cache = _unrolled_step(head, embed, guess, tokens, cache, s)
        m = n - (s - 1)  # queries j = 0 .. m-1 have a target h_{j+s}
        student = lm_head(guess[:, :m])
        loss = loss + F.smooth_l1_loss(guess[:, :m].float(), hidden[:, s:]) + EAGLE_CE_WEIGHT * soft_cross_entropy(student, teacher[:, s - 1 :])
        acc.append(agreement(student, teacher[:, s - 1 :]))
    return Objective(loss / len(acc), acc)


def _unrolled_step(head, embed, prev: torch.Tensor, tokens: torch.Tensor, cache, s: int):
    """Step s of the training-time test: prev [B, n, H] (column j: the guess of h_{j+s-1})
    -> (guesses [B, n, H] of h_{j+s}, the cache with this step's pairs at slots (s-1)n + j).
    Columns past the chunk's end read a clamped token; their guesses are never scored."""
    B, n, _ = prev.shape
    dev = prev.device
    j = torch.arange(n, device=dev)
    grown = head.new_cache(B, s * n)  # a fresh tensor: the earlier steps' K/V stay intact for backward
    for old, new in zip(cache.k + cache.v, grown.k + grown.v):
        new[:, :, : (s - 1) * n] = old[:, :, : (s - 1) * n]
    mask = torch.zeros(n, s * n, dtype=torch.bool, device=dev)
    mask[:, :n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # true pairs 0..j
    for i in range(1, s):
        mask[j, i * n + j] = True  # this column's guess-pairs of steps 2..s
    toks = tokens[:, (j + s).clamp_max(tokens.shape[1] - 1)]  # x_{j+s}
    batch = ForwardBatch(tokens=toks, positions=(j + s - 1).expand(B, n), slots=((s - 1) * n + j).expand(B, n),
                         rows=list(range(B)), kv_len=s * n, given_mask=mask.expand(B, 1, n, s * n), attention="mask")
    return head(prev, embed(toks).to(prev.dtype), batch, grown), grown


def dflash_objective(head, embed, lm_head, hidden: torch.Tensor, tokens: torch.Tensor) -> Objective:
    """hidden [B, T, H] float32, tokens [B, T] -> the block head's loss over its anchors;
    accuracy per block position."""
    B, T, H = hidden.shape
    C, K = head.config.context, head.config.block
    anchors = torch.arange(1, T - K + 1, DFLASH_STRIDE, device=hidden.device)  # P, with P + K - 1 <= T - 1
    A = len(anchors)
    feats, nxt, valid = block_context(hidden, tokens, anchors, C)
    guess = head(feats, embed(nxt).to(hidden.dtype), valid)  # [B*A, K, H]
    target = hidden[:, anchors[:, None] + torch.arange(K, device=hidden.device)].reshape(B * A, K, H)  # h_{P+i-1}
    with torch.no_grad():
        teacher = torch.log_softmax(lm_head(target), dim=-1)
    student = lm_head(guess)
    ce = soft_cross_entropy(student.flatten(0, 1), teacher.flatten(0, 1))
    loss = F.smooth_l1_loss(guess.float(), target) + EAGLE_CE_WEIGHT * ce
    return by_position(loss, [hits(student[:, i], teacher[:, i])[:, None] for i in range(K)])  # [B*A, 1]: a draft per anchor


def block_context(hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, C: int):
    """The block head's inputs at each anchor P of each chunk: (features [B*A, C, H], next
    tokens [B*A, C], valid [B*A, C]) for the pairs (h_t, x_{t+1}), t = P - C .. P - 1, oldest
    first; slots with t < 0 are invalid (their values are placeholders)."""
    B, T, H = hidden.shape
    A = len(anchors)
    t = anchors[:, None] - C + torch.arange(C, device=hidden.device)  # [A, C]
    valid = (t >= 0).expand(B, A, C).reshape(B * A, C)
    t = t.clamp_min(0)
    return hidden[:, t].reshape(B * A, C, H), tokens[:, (t + 1).clamp_max(T - 1)].reshape(B * A, C), valid
