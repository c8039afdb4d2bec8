"""`forerun train`: draft heads (Medusa, EAGLE) fitted to a verifier's own behaviour.

  data.py        text sources -> token chunks (refusing the benchmark sets and the stdlib)
  teacher.py     the verifier teacher-forced over the chunks: hidden states (cached in DIR)
                 and its LM head, from which every next-token target is computed
  objectives.py  the losses and held-out accuracies (pure functions of tensors)
  state.py       checkpoints: the head, the optimizer, the history; --resume
  loop.py        the training run: seeded batches, schedule, tqdm, evaluation, saving
  plot.py        the loss-curve PNG
"""
