"""`forerun train`: its flags (from TrainConfig's defaults) and the command."""
from __future__ import annotations

import sys
from dataclasses import fields

from forerun.train.config import METHODS, PRECISIONS, TrainConfig

HELP = {
    "method": "the head to train",
    "out": "folder for the head (head.safetensors + head.json), the trainer state, the features cache and loss.png",
    "data": "training text, repeatable: a file (.txt/.md/.rst/.py/.jsonl), a folder, or pkg:NAME for an installed "
            "package's source and docs (the benchmark prompt sets and Python's standard library are refused)",
    "model": "the verifier the head drafts for (model folder, .gguf, hub id, or embedded name; default smollm2-135m)",
    "dtype": "verifier precision while computing its hidden states",
    "device": "cpu or cuda",
    "num_heads": "medusa: number of heads; dflash: block positions filled per forward (either way the longest draft)",
    "seq_len": "tokens per training chunk",
    "max_tokens": "tokens read from --data at most",
    "eval_chunks": "held-out chunks for the loss and draft accuracy",
    "batch": "chunks per optimizer step",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW)",
    "warmup": "linear warm-up steps (then linear decay to 10%% of --lr)",
    "eval_every": "steps between held-out evaluations",
    "save_every": "steps between checkpoints",
    "seed": "seed for the data order, the split and the initial weights",
    "unroll": "eagle: training-time test (EAGLE-3): steps 2..N feed the head its own guesses, as drafting does "
              "(each step costs about one more step-1 pass)",
    "intermediate_size": "eagle, dflash: the head's MLP width (default: the verifier's); a narrower head drafts "
                         "faster and learns less",
    "vocab": "score the loss over token ids 0..N-1 and the special tokens only (the first N ids of a BPE are its "
             "most frequent): N/V of the vocabulary's cost per step; serve the head with --draft-vocab N",
    "precision": "the training step's matrix products: bfloat16 runs them under torch.autocast (weights, optimizer "
                 "state, losses and the held-out evaluation stay float32); about 2x faster on CPUs with AVX512-BF16 or "
                 "AMX and on GPUs, slower where bfloat16 is emulated",
    "max_minutes": "stop after this many minutes, saving a checkpoint (--resume continues)",
    "resume": "continue the run saved in --out (same arguments)",
}


def register(sub, kit) -> None:
    """`train` (cli_args.CommandKit)."""
    t = sub.add_parser("train", formatter_class=kit.fmt,  help="train a Medusa, EAGLE or DFlash-style block draft head for a verifier")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "method":
            t.add_argument(flag, required=True, choices=list(METHODS), help=HELP[f.name])
        elif f.name == "out":
            t.add_argument(flag, required=True, help=HELP[f.name])
        elif f.name == "data":
            t.add_argument(flag, action="append", default=[], help=HELP[f.name])
        elif f.name == "resume":
            t.add_argument(flag, action="store_true", help=HELP[f.name])
        elif f.name == "max_minutes":
            t.add_argument(flag, type=float, default=None, help=HELP[f.name])
        elif f.name == "precision":
            t.add_argument(flag, choices=list(PRECISIONS), default=f.default, help=HELP[f.name])
        elif f.name in ("vocab", "intermediate_size"):
            t.add_argument(flag, type=int, default=None, help=HELP[f.name])
        else:
            kind = str if f.type in ("str", "str | None") else {"int": int, "float": float}[f.type]
            t.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])
    t.set_defaults(handler=cmd_train)


def cmd_train(args) -> int:
    from forerun.train.loop import train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    out = train(cfg)
    print(f"head: {out} (load it with --method {cfg.method} --draft-model {out}); loss curve: {out / 'loss.png'}", file=sys.stderr)
    return 0
