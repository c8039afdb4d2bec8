"""Trained draft heads that read the verifier's hidden states (Medusa, EAGLE): the modules,
their checkpoints, and the fingerprint that ties a checkpoint to its verifier.

The drafters that run them live in forerun/drafters (medusa.py, eagle.py); the training
command in forerun/train.
"""
