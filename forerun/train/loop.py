"""The training run behind `forerun train` (and its Python entry point, `train`).

  1. chunks = the --data texts tokenized and cut (data.py); a seeded split holds some out;
  2. the verifier's hidden states over every chunk (teacher.py, cached in --out);
  3. AdamW on the head, batches drawn by a seeded per-epoch permutation (a pure function
     of the step, so --resume needs no data-loader state), linear warm-up then linear
     decay to 10%, gradient norm clipped at 1; --precision bfloat16 runs the step's
     matrix products under torch.autocast (weights, optimizer state and losses float32);
  4. every --eval-every steps the held-out loss and draft accuracy (tqdm shows them);
     every --save-every steps, at the end, on Ctrl-C or SIGTERM and at --max-minutes, a
     checkpoint (state.py) and the loss curve (loss.png).
"""
from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from forerun.errors import ConfigError
from forerun.train import data, plot, state
from forerun.train.config import TrainConfig
from forerun.train.objectives import Objective, dflash_objective, eagle_objective, medusa_objective
from forerun.train.teacher import cached_hidden_states, lm_head_function

GRAD_CLIP = 1.0


def train(cfg: TrainConfig, verifier=None, on_step=None) -> Path:
    """Train (or --resume) a head; returns the --out folder. verifier: an LLM to use instead
    of loading cfg.model; on_step(steps_done) is called after every optimizer step."""
    from forerun.heads.checkpoint import new_head
    from forerun.heads.fingerprint import verifier_fingerprint
    from forerun.llm import LLM

    out = Path(cfg.out)
    if state.exists(out) and not cfg.resume:
        raise ConfigError(f"{out} already holds a training run: add --resume to continue it, or choose another --out")
    torch.manual_seed(cfg.seed)
    llm = verifier or LLM(model=cfg.model, dtype=cfg.dtype, device=cfg.device, speculative=None)
    train_set, held_out = _dataset(cfg, llm, out)
    head = new_head(cfg.method, llm.model, **_head_shape(cfg)).float()
    if cfg.method in ("eagle", "dflash"):  # guesses start on the scale of the verifier's post-norm states
        head.norm.weight.data.copy_(llm.model.model.norm.weight.float())
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    done, history = state.load(out, head, opt, cfg.fixed()) if cfg.resume else (0, [])
    card = {"verifier": llm.name, "verifier_dtype": cfg.dtype, "tokens": int(train_set[0].numel()),
            "fingerprint": verifier_fingerprint(llm.model)}
    step_fn = _objective(cfg.method, head, llm.model, _kept(llm, cfg.vocab), cfg.unroll)
    _run(cfg, head, opt, step_fn, train_set, held_out, done, history, card, on_step)
    return out


def _head_shape(cfg: TrainConfig) -> dict:
    """new_head's overrides of the verifier-shaped default."""
    shape = {} if cfg.method == "eagle" else {"num_heads": cfg.num_heads}
    if cfg.intermediate_size is not None:
        shape["intermediate_size"] = cfg.intermediate_size
    return shape


def _dataset(cfg: TrainConfig, llm, out: Path):
    """((train tokens, train hidden), (held-out tokens, held-out hidden))."""
    from tqdm import tqdm

    from forerun.heads.fingerprint import verifier_fingerprint

    if llm.tokenizer is None:
        raise ConfigError("training reads text: the verifier needs a tokenizer")
    eos = min(llm.eos_ids()) if llm.eos_ids() else 0
    encode = functools.partial(llm.tokenizer.encode, add_special_tokens=False)
    chunks = data.token_chunks(cfg.data, encode, eos, cfg.seq_len, cfg.max_tokens, cfg.seed)
    train_tok, held_tok = data.split(chunks, cfg.eval_chunks, cfg.seed)
    ordered = torch.cat([train_tok, held_tok])
    with tqdm(total=len(ordered), desc="verifier hidden states", unit="chunk", file=sys.stderr) as bar:
        hidden = cached_hidden_states(out, llm.model, ordered, f"{verifier_fingerprint(llm.model)}:{cfg.dtype}", bar.update)
    n = len(train_tok)
    return (train_tok, hidden[:n]), (held_tok, hidden[n:])


def _kept(llm, vocab: int | None):
    """The ids the loss scores under --vocab N (as the draft_vocab option keeps them), or None."""
    from forerun.drafters.draft_vocab import llm_kept_ids

    return None if vocab is None else llm_kept_ids(llm, vocab)


def _objective(method: str, head, model, kept=None, unroll: int = 1):
    lm_head = lm_head_function(model, kept)
    if method == "medusa":
        return lambda hidden, tokens: medusa_objective(head, lm_head, hidden)
    embed = model.model.embed_tokens
    if method == "dflash":
        return lambda hidden, tokens: dflash_objective(head, embed, lm_head, hidden, tokens)
    return lambda hidden, tokens: eagle_objective(head, embed, lm_head, hidden, tokens, unroll)


def _run(cfg: TrainConfig, head, opt, step_fn, train_set, held_out, done: int, history: list[dict], card: dict, on_step):
    from tqdm import tqdm

    out, t0, last_eval = Path(cfg.out), time.perf_counter(), _last_eval(history)
    tokens, hidden = train_set
    dev = next(head.parameters()).device  # features live on the host; batches go where the head is
    if done == 0:  # the starting point of the curve: the untrained head on the held-out chunks
        history.append(evaluate(step_fn, held_out, cfg.batch, dev) | {"step": 0})
    bar = tqdm(total=cfg.steps, initial=done, desc=f"train {cfg.method}", file=sys.stderr)
    try:
        with _stop_on_sigterm() as terminated:
            while done < cfg.steps:
                idx = batch_indices(done, cfg.batch, len(tokens), cfg.seed)
                for g in opt.param_groups:
                    g["lr"] = cfg.lr * lr_scale(done, cfg.warmup, cfg.steps)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16"):
                    res = step_fn(hidden[idx].to(dev).float(), tokens[idx].to(dev))
                opt.zero_grad(set_to_none=True)
                res.loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
                opt.step()
                done += 1
                loss = res.loss.item()
                history.append({"step": done, "loss": loss, "accuracy": res.accuracy[0]})
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    last_eval = evaluate(step_fn, held_out, cfg.batch, dev) | {"step": done}
                    history.append(last_eval)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", held_out_acc=f"{last_eval.get('eval_accuracy', float('nan')):.3f}")
                if done % cfg.save_every == 0:
                    _save(out, head, opt, done, cfg, history, card)
                if on_step is not None:
                    on_step(done)
                if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
                    print(f"forerun: --max-minutes {cfg.max_minutes} reached after {done} steps; --resume continues", file=sys.stderr)
                    break
                if terminated.is_set():
                    print(f"\nforerun: SIGTERM after {done} steps; saved, --resume continues", file=sys.stderr)
                    break
    except KeyboardInterrupt:
        print(f"\nforerun: interrupted after {done} steps; saved, --resume continues", file=sys.stderr)
    finally:
        bar.close()
        _save(out, head, opt, done, cfg, history, card)


@contextlib.contextmanager
def _stop_on_sigterm():
    """While training: SIGTERM (kill, a scheduler's stop) ends the run after the step in
    progress, which then saves a checkpoint as at --max-minutes, so --resume continues
    exactly. (A job started with `&` from a script ignores SIGINT: TERM is the signal that
    reaches it.) Yields the Event the handler sets; outside the main thread none is installed."""
    terminated = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield terminated
        return
    before = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, before)


def _save(out: Path, head, opt, done: int, cfg: TrainConfig, history: list[dict], card: dict) -> None:
    ev = _last_eval(history)
    info = {**card, "held_out_loss": ev.get("eval_loss"), "held_out_accuracy": ev.get("eval_accuracy"),
            "held_out_accuracy_per_position": ev.get("eval_accuracy_all"),
            "held_out_joint_per_position": ev.get("eval_joint_all")}
    state.save(out, head, opt, done, cfg.fixed(), history, info)
    plot.plot_history(history, out / "loss.png", f"{cfg.method} head for {card['verifier']}")


def _last_eval(history: list[dict]) -> dict:
    return next((h for h in reversed(history) if "eval_loss" in h), {})


@torch.no_grad()
def evaluate(step_fn, held_out, batch: int, device) -> dict:
    """Held-out loss and top-1 agreement (mean over chunks; per Medusa head in _all)."""
    tokens, hidden = held_out
    losses, accs, joint, n = 0.0, None, None, 0
    for i in range(0, len(tokens), batch):
        res: Objective = step_fn(hidden[i : i + batch].to(device).float(), tokens[i : i + batch].to(device))
        w = len(tokens[i : i + batch])
        losses += float(res.loss) * w
        accs = [a * w + (accs[j] if accs else 0.0) for j, a in enumerate(res.accuracy)]
        if res.joint is not None:
            joint = [a * w + (joint[j] if joint else 0.0) for j, a in enumerate(res.joint)]
        n += w
    out = {"eval_loss": losses / n, "eval_accuracy": accs[0] / n, "eval_accuracy_all": [a / n for a in accs]}
    if joint is not None:
        out["eval_joint_all"] = [a / n for a in joint]  # positions 1..i all agree (Medusa, block heads)
    return out


def lr_scale(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up over `warmup` steps, then linear decay to 0.1 at `steps`.
    >>> [round(lr_scale(s, 2, 12), 2) for s in (0, 1, 2, 7, 12)]
    [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    if step < warmup:
        return (step + 1) / warmup
    return 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup)


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Chunk indices for a step: positions step*batch .. +batch of a stream that visits all
    n chunks once per epoch, each epoch in its own seeded order (a pure function of step).
    >>> sorted(batch_indices(0, 3, 3, 0)) == [0, 1, 2] == sorted(batch_indices(1, 3, 3, 0))
    True
    """
    return [_epoch_order(n, seed, pos // n)[pos % n] for pos in range(step * batch, (step + 1) * batch)]


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
