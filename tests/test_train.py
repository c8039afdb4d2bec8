"""forerun train on a tiny verifier: train, save, load and draft; exact resume; refusals."""
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from forerun.cli import build_parser
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.heads.fingerprint import verifier_fingerprint
from forerun.llm import LLM
from forerun.train import data
from forerun.train.config import TrainConfig
from forerun.train.loop import train
from tests.tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=30)


class CharTokenizer:
    """Ids 0..31 of the tiny vocabulary as the characters '@'..'_' (0, '@', is EOS)."""

    eos_token_ids = {0}

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 64 if 64 < ord(c) < 96 else 1 + ord(c) % 31 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(64 + i) for i in ids)


@pytest.fixture(scope="module")
def verifier():
    return LLM(tiny_model(seed=0, logit_scale=4.0), tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def corpus(verifier, tmp_path_factory):
    """The verifier's own greedy continuations of random prompts (self-distilled text: what
    it will be asked to draft), in three file formats."""
    root = tmp_path_factory.mktemp("corpus")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 32, (90, 6), generator=g).tolist()
    outs = verifier.generate(prompts, SamplingParams(temperature=0, max_tokens=50), speculative=None)
    texts = [verifier.tokenizer.decode(p + o.token_ids) for p, o in zip(prompts, outs)]
    (root / "a.txt").write_text("\n".join(texts[:30]))
    (root / "b.md").write_text("\n".join(texts[30:60]))
    (root / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[60:]))
    return root


def _cfg(out, corpus, method, **over):
    base = dict(method=method, out=str(out), data=[str(corpus)], seq_len=32, max_tokens=6000, eval_chunks=4,
                batch=4, steps=40, lr=1e-2, warmup=2, eval_every=20, save_every=20, seed=0, num_heads=3)
    base.update(over)
    return TrainConfig(**base)


@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash"])
def test_train_then_load_and_draft(verifier, corpus, tmp_path, method):
    out = train(_cfg(tmp_path / "h", corpus, method, **({"steps": 60, "eval_every": 30} if method == "dflash" else {})), verifier=verifier)
    for name in ("head.safetensors", "head.json", "trainer.safetensors", "trainer.json", "features.safetensors", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    card = json.loads((out / "head.json").read_text())
    assert card["method"] == method and card["verifier"]["fingerprint"] == verifier_fingerprint(verifier.model)
    history = json.loads((out / "trainer.json").read_text())["history"]
    evals = [h for h in history if "eval_loss" in h]
    assert [e["step"] for e in evals] == ([0, 30, 60] if method == "dflash" else [0, 20, 40])  # untrained, then every --eval-every
    assert evals[-1]["eval_loss"] < 0.9 * evals[0]["eval_loss"]  # it learned the verifier's behaviour, held out
    if method != "medusa":  # (an untrained Medusa head repeats the verifier's next token: on this repetitive
        assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"] + 0.1  # text a strong baseline for 40 steps)
    assert card["training"]["held_out_accuracy"] == evals[-1]["eval_accuracy"]
    if method != "eagle":  # positions 1..i all agreeing: what a chain's acceptance needs
        joint, alone = evals[-1]["eval_joint_all"], evals[-1]["eval_accuracy_all"]
        assert card["training"]["held_out_joint_per_position"] == joint and len(joint) == len(alone) == 3
        # (Medusa's joint figures count only the starts every head has: 29 of 31 here)
        assert joint[0] == pytest.approx(alone[0], abs=0.05) and all(j <= a + 0.05 for j, a in zip(joint, alone))
        assert all(b <= a for a, b in zip(joint, joint[1:])) and joint[1] > 0
    # the saved head drafts for its verifier: greedy output is plain decoding's, drafts get accepted
    prompts = torch.randint(1, 32, (4, 6), generator=torch.Generator().manual_seed(9)).tolist()
    plain = verifier.generate(prompts, GREEDY, speculative=None)
    got = verifier.generate(prompts, GREEDY, speculative=SpeculativeConfig(method, 3, draft_model=str(out)))
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in got) > 0


@pytest.mark.parametrize("method,over", [("eagle", {"unroll": 2}), ("dflash", {}), ("medusa", {})])
def test_bfloat16_steps_train_a_head_that_drafts_exactly(verifier, corpus, tmp_path, method, over):
    """--precision bfloat16: the step's products under autocast (the weights differ from the
    float32 run's, so the option is in effect), still learning; evaluation and serving as before."""
    from safetensors.torch import load_file

    cfg = dict(steps=30, eval_every=30, save_every=30, **over)
    f32 = train(_cfg(tmp_path / "f", corpus, method, **cfg), verifier=verifier)
    bf16 = train(_cfg(tmp_path / "b", corpus, method, precision="bfloat16", **cfg), verifier=verifier)
    a, b = load_file(str(f32 / "head.safetensors")), load_file(str(bf16 / "head.safetensors"))
    assert a.keys() == b.keys() and all(b[k].dtype == torch.float32 for k in b)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    evals = [h for h in json.loads((bf16 / "trainer.json").read_text())["history"] if "eval_loss" in h]
    assert evals[-1]["eval_loss"] < 0.9 * evals[0]["eval_loss"]
    prompts = torch.randint(1, 32, (3, 6), generator=torch.Generator().manual_seed(5)).tolist()
    plain = verifier.generate(prompts, GREEDY, speculative=None)
    got = verifier.generate(prompts, GREEDY, speculative=SpeculativeConfig(method, 3, draft_model=str(bf16)))
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    with pytest.raises(ConfigError, match="--precision"):
        _cfg(tmp_path / "x", corpus, method, precision="float16")


def test_train_over_a_reduced_vocabulary(verifier, corpus, tmp_path):
    """--vocab N: the loss scores ids 0..N-1 (+ EOS) only; the head drafts over them by
    default (an explicit draft_vocab wins), and output stays plain decoding's."""
    from forerun.drafters.draft_vocab import head_logits

    out = train(_cfg(tmp_path / "v", corpus, "eagle", steps=20, eval_every=20, save_every=20, vocab=20), verifier=verifier)
    assert json.loads((out / "head.json").read_text())["training"]["vocab"] == 20
    h = torch.randn(3, verifier.model.config.hidden_size)
    z = head_logits(SpeculativeConfig("eagle", 3, draft_model=str(out)), verifier)(h)
    assert torch.isfinite(z[:, :20]).all() and torch.isinf(z[:, 20:]).all()
    z = head_logits(SpeculativeConfig("eagle", 3, draft_model=str(out), options={"draft_vocab": 24}), verifier)(h)
    assert torch.isfinite(z[:, :24]).all() and torch.isinf(z[:, 24:]).all()
    prompts = torch.randint(1, 32, (3, 6), generator=torch.Generator().manual_seed(4)).tolist()
    plain = verifier.generate(prompts, GREEDY, speculative=None)
    got = verifier.generate(prompts, GREEDY, speculative=SpeculativeConfig("eagle", 3, draft_model=str(out)))
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    with pytest.raises(ConfigError, match="--vocab"):
        _cfg(tmp_path / "w", corpus, "eagle", vocab=1)


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_a_narrower_head_trains_loads_and_drafts_exactly(verifier, corpus, tmp_path, method):
    """--intermediate-size: the head's MLP narrower than the verifier's; the width is in
    head.json, so serving builds the same shape, and output stays plain decoding's."""
    from safetensors.torch import load_file

    width = verifier.model.config.intermediate_size // 4
    out = train(_cfg(tmp_path / "n", corpus, method, steps=20, eval_every=20, save_every=20, intermediate_size=width),
                verifier=verifier)
    assert json.loads((out / "head.json").read_text())["config"]["intermediate_size"] == width
    down = [t for k, t in load_file(str(out / "head.safetensors")).items() if k.endswith(("down_proj.weight", "down.weight"))]
    assert down and all(t.shape[1] == width for t in down)
    prompts = torch.randint(1, 32, (3, 6), generator=torch.Generator().manual_seed(6)).tolist()
    plain = verifier.generate(prompts, GREEDY, speculative=None)
    got = verifier.generate(prompts, GREEDY, speculative=SpeculativeConfig(method, 3, draft_model=str(out)))
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    with pytest.raises(ConfigError, match="differ from the run"):  # the width is fixed on --resume
        train(_cfg(tmp_path / "n", corpus, method, steps=20, eval_every=20, save_every=20, resume=True), verifier=verifier)
    with pytest.raises(ConfigError, match="--intermediate-size"):
        _cfg(tmp_path / "m", corpus, "medusa", intermediate_size=width)
    with pytest.raises(ConfigError, match="--intermediate-size"):
        _cfg(tmp_path / "m", corpus, method, intermediate_size=0)


def test_joint_agreement_counts_starts_where_every_position_so_far_agrees():
    from forerun.train.objectives import joint_agreement

    T, F = True, False
    per = [torch.tensor([[T, T, F, T], [T, F, T, T]]), torch.tensor([[F, T, T], [T, F, T]]), torch.tensor([[T, T], [T, T]])]
    # the common starts are 0 and 1: position 0 agrees on 3 of 4, positions 0-1 on 2 (row 0 start 1,
    # row 1 start 0), positions 0-2 on the same 2
    assert joint_agreement(per) == [0.75, 0.5, 0.5]
    assert joint_agreement([torch.tensor([[F, T]])]) == [0.5]


def test_training_time_test_steps_equal_drafting_from_guesses():
    """--unroll: step s of the objective computes, for every column j at once, what drafting
    computes after the true pairs 0..j: the head fed its own guesses, s - 1 deep."""
    from forerun.heads.checkpoint import new_head
    from forerun.kv.cache import chain_batch
    from forerun.train.objectives import _unrolled_step, eagle_objective

    model = tiny_model(seed=0)
    dt = model.model.embed_tokens.weight.dtype
    head = new_head("eagle", model).to(dt)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    B, T, H = 2, 8, model.config.hidden_size
    hidden, tokens = torch.randn(B, T, H, dtype=dt), torch.randint(0, 32, (B, T))
    embed, n, cpu = model.model.embed_tokens, T - 1, torch.device("cpu")
    with torch.no_grad():
        batch = chain_batch(tokens[:, 1:].tolist(), [0] * B, list(range(B)), cpu)
        cache = head.new_cache(B, n)
        g = [head(hidden[:, :-1], embed(batch.tokens), batch, cache)]
        for s in (2, 3):
            nxt, cache = _unrolled_step(head, embed, g[-1], tokens, cache, s)
            g.append(nxt)
        for b in range(B):
            for j in range(n - 2):
                c = head.new_cache(1, j + 3)
                first = chain_batch([tokens[b, 1 : j + 2].tolist()], [0], [0], cpu)  # true pairs 0..j
                r = head(hidden[b : b + 1, : j + 1], embed(first.tokens), first, c)[:, -1]
                torch.testing.assert_close(r[0], g[0][b, j])
                for s in (2, 3):  # the pair (guess, x_{j+s}) at position j + s - 1
                    step = chain_batch([[int(tokens[b, j + s])]], [j + s - 1], [0], cpu)
                    r = head(r[:, None], embed(step.tokens), step, c)[:, -1]
                    torch.testing.assert_close(r[0], g[s - 1][b, j], atol=1e-5, rtol=1e-4)
    lm = lambda h: h @ embed.weight.T  # noqa: E731
    one = eagle_objective(head, embed, lm, hidden, tokens)
    three = eagle_objective(head, embed, lm, hidden, tokens, unroll=3)
    assert len(one.accuracy) == 1 and len(three.accuracy) == 3 and three.accuracy[0] == one.accuracy[0]
    three.loss.backward()  # the steps' K/V chain stays differentiable
    assert all(p.grad is not None for p in head.parameters())


class FutureHeads:
    """Medusa 'heads' that cheat: head i at position t returns the true h_{t+1+i}."""

    def __init__(self, hidden, k):
        self.hidden, self.config = hidden, TrainConfig.__new__(TrainConfig)
        self.config.num_heads = k

    def __call__(self, h):
        T, full = h.shape[1], self.hidden
        pad = lambda i: torch.cat([full[:, 1 + i :], full[:, -1:].expand(-1, i, -1)], 1)[:, :T]  # noqa: E731
        return torch.stack([pad(i) for i in range(self.config.num_heads)], dim=2)


class FutureEagle:
    """An EAGLE 'head' that cheats: its guess for pair j is the true h_{j+1}."""

    def __init__(self, hidden):
        self.hidden = hidden

    def new_cache(self, *shape):
        return None

    def __call__(self, feats, embeds, batch, cache):
        return self.hidden[:, 1:]


class FutureBlock:
    """A block 'head' that cheats: at anchor P its position i returns the true h_{P+i-1}."""

    def __init__(self, hidden, block, context):
        from forerun.heads.dflash import DFlashConfig

        self.hidden, self.config = hidden, DFlashConfig(8, 8, 2, block=block, context=context)

    def __call__(self, feats, embeds, valid):
        from forerun.train.objectives import DFLASH_STRIDE

        B, T, _ = self.hidden.shape
        K = self.config.block
        anchors = list(range(1, T - K + 1, DFLASH_STRIDE))
        rows = [self.hidden[r // len(anchors), anchors[r % len(anchors)] : anchors[r % len(anchors)] + K] for r in range(len(feats))]
        return torch.stack(rows)


def test_objectives_are_aligned_with_the_drafters():
    """Heads that read the verifier's future states reach the minimum: the loss is the
    teacher's own entropy and every top-1 guess agrees, so each target sits at the position
    the drafter reads it from (a shift by one would fail both)."""
    from forerun.train.objectives import dflash_objective, eagle_objective, medusa_objective

    torch.manual_seed(0)
    hidden, W = torch.randn(2, 9, 8), torch.randn(16, 8)
    lm_head = lambda h: h @ W.T  # noqa: E731
    logp = torch.log_softmax(lm_head(hidden), -1)  # p_m at position m
    entropy = lambda a: float(-(logp[:, a:].exp() * logp[:, a:]).sum(-1).mean())  # noqa: E731
    res = medusa_objective(FutureHeads(hidden, 3), lm_head, hidden)
    assert res.accuracy == [1.0, 1.0, 1.0]
    assert abs(float(res.loss) - sum(entropy(1 + i) for i in range(3)) / 3) < 1e-5
    res = eagle_objective(FutureEagle(hidden), torch.nn.Embedding(16, 8), lm_head, hidden, torch.randint(0, 16, (2, 9)))
    assert res.accuracy == [1.0] and abs(float(res.loss) - 0.1 * entropy(1)) < 1e-5
    res = dflash_objective(FutureBlock(hidden, 3, 4), torch.nn.Embedding(16, 8), lm_head, hidden, torch.randint(0, 16, (2, 9)))
    anchors = torch.arange(1, 9 - 3 + 1, 3)  # P = 1, 4: targets h_P .. h_{P+2}
    pos = (anchors[:, None] + torch.arange(3)).flatten()
    want = float(-(logp[:, pos].exp() * logp[:, pos]).sum(-1).mean())
    assert res.accuracy == [1.0, 1.0, 1.0] and abs(float(res.loss) - 0.1 * want) < 1e-5


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_resume_continues_exactly(verifier, corpus, tmp_path, how):
    """Interrupted at step 4 (Ctrl-C, or SIGTERM as `kill` sends), resumed: the same weights
    as an uninterrupted run."""
    straight = train(_cfg(tmp_path / "a", corpus, "eagle", steps=8, eval_every=3, save_every=100), verifier=verifier)

    def stop(step):
        if step == 4:
            if how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the run: it ends after this step

    before = signal.getsignal(signal.SIGTERM)
    part = _cfg(tmp_path / "b", corpus, "eagle", steps=8, eval_every=3, save_every=100)
    train(part, verifier=verifier, on_step=stop)
    assert json.loads((tmp_path / "b" / "trainer.json").read_text())["steps_done"] == 4
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone
    part.resume = True
    train(part, verifier=verifier)
    from safetensors.torch import load_file

    a, b = load_file(str(straight / "head.safetensors")), load_file(str(tmp_path / "b" / "head.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ha = json.loads((straight / "trainer.json").read_text())["history"]
    hb = json.loads((tmp_path / "b" / "trainer.json").read_text())["history"]
    assert ha == hb


def test_refusals(verifier, corpus, tmp_path):
    from forerun.prompts import data_dir

    with pytest.raises(ConfigError, match="benchmark prompt sets"):
        data.check_allowed(data_dir() / "SVAMP.json")
    with pytest.raises(ConfigError, match="standard library"):
        data.check_allowed(Path(json.__file__))
    data.check_allowed(Path(torch.__file__))  # site-packages are fine
    train(_cfg(tmp_path / "h", corpus, "medusa", steps=2, eval_every=2), verifier=verifier)
    with pytest.raises(ConfigError, match="already holds a training run"):
        train(_cfg(tmp_path / "h", corpus, "medusa", steps=2), verifier=verifier)
    with pytest.raises(ConfigError, match="differ from the run"):
        train(_cfg(tmp_path / "h", corpus, "medusa", steps=3, resume=True), verifier=verifier)
    with pytest.raises(ConfigError, match="no installed package"):
        data.source_files("pkg:no-such-package-here")
    with pytest.raises(ConfigError, match="at least one text source"):
        TrainConfig(method="eagle", out=str(tmp_path))


def test_jsonl_rows_and_package_sources(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a"}\n{"turns": ["b", "c"]}\n"d"\n{"other": 1}\n')
    assert data.read_texts(f) == ["a", "b", "c", "d"]
    files = data.source_files("pkg:tqdm")
    assert files and all(p.suffix in data.TEXT_SUFFIXES for p in files)


def test_a_large_jsonl_file_is_read_and_a_large_source_file_is_not(tmp_path):
    """The size cap keeps data tables out of package sources; a distilled JSONL past it (2 MB
    after ~1,100 SmolLM2 answers) was once skipped whole, silently."""
    row = '{"text": "' + "x" * 999 + '"}\n'
    big = tmp_path / "answers.jsonl"
    big.write_text(row * (data.MAX_FILE_BYTES // len(row) + 10))
    assert len(data.read_texts(big)) == data.MAX_FILE_BYTES // len(row) + 10
    table = tmp_path / "table.py"
    table.write_text("x = 1\n" * (data.MAX_FILE_BYTES // 6 + 10))
    assert data.read_texts(table) == []


def test_cli_flags_make_the_config(tmp_path):
    args = build_parser().parse_args(["train", "--method", "eagle", "--out", str(tmp_path), "--data", "pkg:tqdm",
                                      "--data", "notes.txt", "--steps", "7", "--lr", "0.001", "--max-minutes", "2",
                                      "--precision", "bfloat16", "--intermediate-size", "64"])
    from dataclasses import fields

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    assert (cfg.method, cfg.data, cfg.steps, cfg.lr, cfg.max_minutes, cfg.resume) == ("eagle", ["pkg:tqdm", "notes.txt"], 7, 0.001, 2.0, False)
    assert cfg.precision == "bfloat16" and cfg.intermediate_size == 64
