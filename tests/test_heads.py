"""Medusa, EAGLE and DFlash heads: greedy identity (chains and trees), drafts equal to a from-scratch
reference computation, checkpoints and the verifier fingerprint."""
import pytest
import torch

from forerun.config import SpeculativeConfig
from forerun.drafters.base import DraftRequest
from forerun.errors import ConfigError, ModelLoadError
from forerun.heads.checkpoint import load_head, new_head, save_head
from forerun.heads.fingerprint import verifier_fingerprint
from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from forerun.metrics import merge
from tests.test_greedy_identity import GREEDY, PROMPTS, plain, verifier  # noqa: F401 (the same prompts and fixtures)
from tests.tiny import tiny_model


def random_head(method, verifier, seed=1, **config):
    """An untrained head with random weights (Medusa's zero init would only repeat the
    verifier's next token)."""
    head = new_head(method, verifier.model, **config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.double()


@pytest.fixture(scope="module")
def heads(verifier):
    return {"medusa": random_head("medusa", verifier, num_heads=4), "eagle": random_head("eagle", verifier),
            "dflash": random_head("dflash", verifier, num_heads=4)}


TREES = {"chain": (1, {}), "tree": (3, {"tree_nodes": 7, "tree_beam": 2})}


@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash"])
def test_greedy_identity(verifier, plain, heads, method, k, shape):
    width, options = TREES[shape]
    spec = SpeculativeConfig(method, k, draft_model=heads[method], tree_width=width, options=options)
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    st = merge([o.stats for o in outs])
    assert st.drafted > 0 and st.accepted > 0
    alone = [verifier.generate([p], GREEDY, speculative=spec)[0].token_ids for p in PROMPTS]
    assert alone == plain


@pytest.mark.parametrize("context", [True, False])
@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash"])
def test_reduced_draft_vocab_drafts_only_kept_ids_and_stays_exact(verifier, plain, heads, method, context):
    """Drafts come from the first 12 ids, or (draft_vocab_context, the default) from the
    ids already in the rows' context."""
    spec = SpeculativeConfig(method, 3, draft_model=heads[method], tree_width=2,
                             options={"draft_vocab": 12, "tree_nodes": 5, "draft_vocab_context": context})
    drafted = []
    d = verifier.drafter_for(spec)
    real = d.propose
    d.propose = lambda *a: [drafted.extend(x.tokens) or x for x in real(*a)]
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    seen = {t for p, out in zip(PROMPTS, plain) for t in p + out}
    assert drafted and all(t < 12 or (context and t in seen) for t in drafted)
    if context and any(t >= 12 for t in seen):
        assert any(t >= 12 for t in drafted)  # context ids are drafted


@pytest.mark.parametrize("head_dtype", ["int8", "int4"])
@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash"])
def test_a_quantized_reduced_head_stays_exact(verifier, plain, heads, method, head_dtype):
    """head_dtype: the reduced head that scores drafts runs at int8 / int4 under a float
    verifier (as the head's layers do); drafts change at most, the output does not."""
    spec = SpeculativeConfig(method, 3, draft_model=heads[method], options={"draft_vocab": 40, "head_dtype": head_dtype})
    head = verifier.drafter_for(spec).logits.head.head
    assert type(head).__name__ == {"int8": "Int8Linear", "int4": "Int4Linear"}[head_dtype]
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).accepted > 0


def test_head_dtype_is_checked():
    with pytest.raises(ConfigError, match="head_dtype"):
        SpeculativeConfig("eagle", 3, options={"draft_vocab": 40, "head_dtype": "int2"})


@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash"])
def test_adaptive_k_mixes_draft_lengths_and_skipped_rows(verifier, plain, heads, method):
    """k='auto' gives rows different k per step, 0 included: a row that skips drafting must
    catch up on every hidden state it missed (EAGLE's head cache) when it drafts again."""
    spec = SpeculativeConfig(method, "auto", draft_model=heads[method],
                             options={"k_max": 4, "verify_cost": [1.0, 1.0, 1.05, 1.1, 1.2]})
    ks = set()
    d = verifier.drafter_for(spec)
    real = d.propose
    d.propose = lambda reqs, *a: ks.update(r.k for r in reqs) or real(reqs, *a)
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).accepted > 0
    assert 0 in ks and len(ks) >= 3, ks


def test_int8_chains_equal_int8_plain_decoding():
    """At int8 (batch-invariant kernels) a chain's verification gives plain decoding's bits."""
    from forerun.kernels import loader as kernel_loader

    from forerun.heads.checkpoint import at_verifier_precision
    from forerun.linears.int8 import Int8Linear

    if kernel_loader.load() is None:
        pytest.skip("needs the compiled int8 kernels")
    llm = LLM(tiny_model(seed=0, dtype="int8", hidden_size=64, intermediate_size=128), dtype="int8")
    plain8 = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, speculative=None)]
    for method in ("medusa", "eagle", "dflash"):
        head = new_head(method, llm.model)
        torch.manual_seed(3)
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0, 0.3)
        outs = llm.generate(PROMPTS, GREEDY, speculative=SpeculativeConfig(method, 3, draft_model=head))
        assert [o.token_ids for o in outs] == plain8, method
        # under an int8 verifier the head drafts with int8 linears (a copy: the given head stays float)
        spec = SpeculativeConfig(method, 3, draft_model=head)
        assert any(isinstance(m, Int8Linear) for m in at_verifier_precision(head, spec, llm).modules())
        assert not any(isinstance(m, Int8Linear) for m in head.modules())
        spec = SpeculativeConfig(method, 3, draft_model=head, options={"head_dtype": "float32"})
        assert not any(isinstance(m, Int8Linear) for m in at_verifier_precision(head, spec, llm).modules())


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_int8_head_keeps_the_embedding_half_of_its_input(method):
    """fc reads [features; embeddings]; features run ~100x larger. The int8 copy scales each
    half on its own (SplitInputLinear), so the token's embedding still reaches the head: its
    fc output stays within a few percent of the float head's, and the embedding half moves it."""
    from forerun.heads.checkpoint import at_verifier_precision
    from forerun.heads.eagle import SplitInputLinear

    llm = LLM(tiny_model(seed=0, dtype="int8", hidden_size=64, intermediate_size=128), dtype="int8")
    head = new_head(method, llm.model)
    fc8 = at_verifier_precision(head, SpeculativeConfig(method, 3, draft_model=head), llm).fc
    assert isinstance(fc8, SplitInputLinear)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(5, 64, generator=g) * 4
    feats[:, 7] = 120.0  # an outlier channel, as Qwen2.5's post-norm states have
    embeds = torch.randn(5, 64, generator=g) * 0.02
    with torch.no_grad():
        want = head.fc(torch.cat([feats, embeds], -1)) - head.fc(torch.cat([feats, torch.zeros_like(embeds)], -1))
        got = fc8(torch.cat([feats, embeds], -1)) - fc8(torch.cat([feats, torch.zeros_like(embeds)], -1))
    assert want.norm() > 0
    assert (got - want).norm() < 0.05 * want.norm()  # the embeddings' contribution survives at int8


# -- drafts equal a from-scratch computation ------------------------------------------------
def _drafter(verifier, spec, seq):
    """A drafter that has seen the hidden states of `seq` but its last token (pending, as after a
    step), ready to propose."""
    from forerun.engine import write_known
    from forerun.prefill import PrefixWrite

    d = verifier.drafter_for(spec)
    cache = verifier.model.new_cache(1, 64)
    d.start(1, 64, cache)
    write_known(verifier.model, cache, [PrefixWrite(0, 0, list(seq[:-1]))], d)
    return d


def _hidden(model, ids):
    return model(chain_batch([ids], [0], [0], model.device), model.new_cache(1, len(ids)), logits_at=None).hidden[0]


def _eagle_logp(verifier, head, seq, path):
    """log q of the token after seq + path, computed from nothing: true pairs for seq, then
    the head's own guesses for the drafted path, in a fresh cache."""
    m = verifier.model
    feats = list(_hidden(m, seq[:-1]))
    toks = list(seq[1:])
    out = None
    for i in range(len(path) + 1):
        if i:
            feats.append(out[0, -1])
            toks.append(path[i - 1])
        batch = chain_batch([toks], [0], [0], m.device)
        emb = m.model.embed_tokens(batch.tokens)
        out = head(torch.stack(feats)[None], emb, batch, head.new_cache(1, len(toks)))
    return torch.log_softmax(m.hidden_to_logits(out[0, -1]), -1)


@torch.inference_mode()
def test_eagle_chain_equals_reference(verifier, heads):
    seq = PROMPTS[2]
    d = _drafter(verifier, SpeculativeConfig("eagle", 4, draft_model=heads["eagle"]), seq)
    draft = d.propose([DraftRequest(0, seq, 4)], GREEDY, None)[0]
    for i, tok in enumerate(draft.tokens):
        assert tok == int(_eagle_logp(verifier, heads["eagle"], seq, draft.tokens[:i]).argmax())


@torch.inference_mode()
def test_eagle_tree_scores_equal_reference(verifier, heads):
    """Every candidate's score is the summed log q of its path computed from scratch (so the
    tree mask, positions and slots of the fed nodes are right), and the draft is the best
    `tree_nodes` of them."""
    from forerun.drafters.eagle_tree import candidates

    seq = PROMPTS[0]
    spec = SpeculativeConfig("eagle", 3, draft_model=heads["eagle"], tree_width=3, options={"tree_nodes": 9, "tree_beam": 2})
    d = _drafter(verifier, spec, seq)
    req = DraftRequest(0, seq, 3)
    tree = candidates(d, [req], d._catch_up([req]), [3])[0]
    assert len(tree.tokens) == 3 + 2 * 2 * 3  # root's 3, then 2 expanded nodes x 3 children per depth
    for i, score in enumerate(tree.scores):
        path, n = [], i
        while n >= 0:
            path.insert(0, tree.tokens[n])
            n = tree.parents[n]
        ref = sum(float(_eagle_logp(verifier, heads["eagle"], seq, path[:j])[path[j]]) for j in range(len(path)))
        assert abs(ref - score) < 1e-5, (i, path)  # scores are float32 sums
    d.synced = {}
    draft = d.propose([req], GREEDY, None)[0]
    best = sorted(range(len(tree.scores)), key=lambda i: (-tree.scores[i], i))[:9]
    assert sorted(draft.tokens) == sorted(tree.tokens[i] for i in best) and len(draft.tokens) == 9


@torch.inference_mode()
def test_medusa_chain_equals_reference(verifier, heads):
    seq = PROMPTS[2]
    h = heads["medusa"]
    d = _drafter(verifier, SpeculativeConfig("medusa", 3, draft_model=h), seq)
    draft = d.propose([DraftRequest(0, seq, 3)], GREEDY, None)[0]
    last = _hidden(verifier.model, seq[:-1])[-1]
    want = verifier.model.hidden_to_logits(h(last)).argmax(-1).tolist()[:3]
    assert draft.tokens == want


@torch.inference_mode()
def test_medusa_tree_is_the_most_confident_rank_paths(verifier, heads):
    h = heads["medusa"]
    seq = PROMPTS[0]
    d = _drafter(verifier, SpeculativeConfig("medusa", 2, draft_model=h, tree_width=3, options={"tree_nodes": 5}), seq)
    draft = d.propose([DraftRequest(0, seq, 2)], GREEDY, None)[0]
    logp = torch.log_softmax(verifier.model.hidden_to_logits(h(_hidden(verifier.model, seq[:-1])[-1])), -1)[:2]
    paths = {(a,): float(logp[0, a]) for a in logp[0].topk(3).indices.tolist()}
    paths.update({(a, b): paths[(a,)] + float(logp[1, b]) for (a,) in list(paths) for b in logp[1].topk(3).indices.tolist()})
    best = sorted(paths, key=lambda p: -paths[p])[:5]
    got = []
    for i, tok in enumerate(draft.tokens):
        p = draft.parents[i]
        got.append((tok,) if p < 0 else (draft.tokens[p], tok))
    assert sorted(got) == sorted(best)


@torch.inference_mode()
@pytest.mark.parametrize("seq", [PROMPTS[2], PROMPTS[2][:5]])  # a full context, and fewer than `context` states
def test_dflash_block_equals_the_training_objective(verifier, heads, seq):
    """The drafter's block for a row is what training scores for the same anchor: the head on
    (f_t, x_{t+1}), t = P - C .. P - 1 (missing t masked), read through the LM head."""
    from forerun.train.objectives import block_context

    h = heads["dflash"]
    m = verifier.model
    d = _drafter(verifier, SpeculativeConfig("dflash", 4, draft_model=h), seq)
    draft = d.propose([DraftRequest(0, seq, 4)], GREEDY, None)[0]
    P, C = len(seq) - 1, h.config.context
    hid = _hidden(m, seq[:-1])  # f_0 .. f_{P-1}
    t = list(range(max(0, P - C), P))
    pad = C - len(t)
    feats = torch.cat([hid.new_zeros(pad, hid.shape[-1]), hid[t]])[None]
    toks = torch.tensor([[0] * pad + seq[t[0] + 1 :]])
    valid = torch.tensor([[False] * pad + [True] * len(t)])
    want = m.hidden_to_logits(h(feats, m.model.embed_tokens(toks).to(feats.dtype), valid)[0]).argmax(-1).tolist()
    assert draft.tokens == want
    # training builds the same inputs for an anchor at P (its placeholders aside)
    full = list(seq) + [1, 2, 3, 4]
    tf, tt, tv = block_context(_hidden(m, full)[None], torch.tensor([full]), torch.tensor([P]), C)
    assert torch.equal(tv, valid) and torch.equal(tt[tv], toks[valid])
    torch.testing.assert_close(tf[tv], feats[valid], rtol=1e-9, atol=1e-9)  # float64: two forward shapes


# -- checkpoints and fingerprints ----------------------------------------------------------
def test_save_load_round_trip_and_refusals(verifier, heads, tmp_path):
    save_head(tmp_path / "h", heads["eagle"], "tiny")
    loaded = load_head(tmp_path / "h", "eagle", verifier.model)
    for (name, a), b in zip(heads["eagle"].state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), msg=name)
    other = LLM(tiny_model(seed=5))
    with pytest.raises(ConfigError, match="trained for another verifier"):
        other.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("eagle", 2, draft_model=str(tmp_path / "h")))
    with pytest.raises(ConfigError, match="is a eagle head, not medusa"):
        load_head(tmp_path / "h", "medusa", verifier.model)
    with pytest.raises(ModelLoadError, match="not a forerun head"):
        load_head(tmp_path, "eagle", verifier.model)
    with pytest.raises(ConfigError, match="needs draft_model="):
        verifier.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("medusa", 2))


def test_fingerprint_is_the_same_at_every_precision_and_differs_across_models():
    prints = {verifier_fingerprint(tiny_model(seed=0, dtype=d, hidden_size=64, intermediate_size=128))
              for d in ("float32", "bfloat16", "int8")}
    assert len(prints) == 1
    assert verifier_fingerprint(tiny_model(seed=1, hidden_size=64, intermediate_size=128)) not in prints
