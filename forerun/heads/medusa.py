"""Medusa heads (Cai et al. 2024): K extra next-next-token predictors on the verifier's last
hidden state, each one residual block whose output goes through the verifier's own LM head.

Alignment, with h_t the verifier's hidden state (after its final norm) at input token x_t:
  verifier:  lm_head(h_t)               -> x_{t+1} (the token the verifier itself commits)
  head i:    lm_head(h_t + SiLU(W_i h_t + b_i)) -> x_{t+2+i},  i = 0 .. K-1
so at decode time, with h the state that predicted the pending token, head i drafts the
token i + 1 positions after the pending one. W_i and b_i start at zero: an untrained head
repeats the verifier's next-token guess.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forerun.errors import ConfigError


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int = 4

    def __post_init__(self):
        if self.hidden_size < 1 or not 1 <= self.num_heads <= 16:
            raise ConfigError(f"Medusa needs hidden_size >= 1 and 1 <= num_heads <= 16, got {self}")

    @classmethod
    def for_verifier(cls, model_config, num_heads: int = 4) -> "MedusaConfig":
        return cls(model_config.hidden_size, num_heads)


class MedusaHeads(nn.Module):
    """hidden [..., H] -> [..., K, H] per-head features for the verifier's LM head."""

    kind = "medusa"

    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.config = cfg
        H, K = cfg.hidden_size, cfg.num_heads
        self.proj = nn.Linear(H, K * H)  # the K heads' W_i stacked: one GEMM for all of them
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        K, H = self.config.num_heads, self.config.hidden_size
        branch = F.silu(self.proj(hidden)).unflatten(-1, (K, H))  # [..., K, H]
        return hidden.unsqueeze(-2) + branch
