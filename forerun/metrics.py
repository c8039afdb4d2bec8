"""Per-sequence speculative-decoding statistics, in the verify.py vocabulary."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    generated: int = 0  # tokens emitted for the user (after stop/max_tokens truncation)
    drafted: int = 0  # draft tokens proposed and scored by the verifier
    accepted: int = 0  # draft tokens the verifier kept
    rejections: int = 0  # steps that ended in a recovered token (a draft token refused)
    bonus: int = 0  # steps whose whole non-empty draft was accepted
    verifier_forwards: int = 0  # decode steps (one verifier forward each; prefill not counted)
    prefill_tokens: int = 0  # tokens sampled from the prefill's logits (the first one: no step of its own)
    accepted_at: list[int] = field(default_factory=list)  # [k] accepts per draft position
    drafted_at: list[int] = field(default_factory=list)  # [k] steps whose draft reached each position
    # One letter per generated token, where it came from (forerun/bench/provenance.py):
    # "a" accepted draft token, "r" recovered (the verifier's token where a draft token was refused),
    # "b" bonus (after a fully accepted draft), "p" plain (a step that drafted nothing).
    origins: str = ""
    prefill_time: float = 0.0  # seconds
    decode_time: float = 0.0  # seconds, from the end of prefill to the last token
    draft_time: float = 0.0  # seconds spent in the drafter (shared by the batch)
    verify_time: float = 0.0  # seconds spent in verifier forwards + verification
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed)
    prefill_chunks: int = 0  # the server's forwards that computed this prompt (chunked prefill)
    forced: int = 0  # tokens a grammar forced into drafts and the verifier kept (not in drafted / accepted)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per verifier forward, empty-draft steps included (Spec-Bench); the
        first token, which the prefill's forward gave, is not a step's."""
        return self.decoded / self.verifier_forwards if self.verifier_forwards else 0.0

    @property
    def decoded(self) -> int:
        """Tokens the decoding steps emitted (all but what the prefill gave)."""
        return max(0, self.generated - self.prefill_tokens)

    @property
    def wall_time(self) -> float:
        """Seconds a user waited: prefill + decode."""
        return self.prefill_time + self.decode_time

    @property
    def tokens_per_s(self) -> float:
        t = self.wall_time
        return self.generated / t if t > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded / self.decode_time if self.decode_time > 0 else 0.0

    def record_step(self, draft_len: int, num_accepted: int, bonus: bool | None = None):
        """draft_len: tokens the step could accept (a tree's depth); bonus: the step ended
        past its last candidate (a chain: everything accepted)."""
        self.verifier_forwards += 1
        self.drafted += draft_len
        self.accepted += num_accepted
        if bonus is None:
            bonus = draft_len > 0 and num_accepted == draft_len
        if bonus:
            self.bonus += 1
        elif draft_len > 0:
            self.rejections += 1
        while len(self.accepted_at) < draft_len:
            self.accepted_at.append(0)
            self.drafted_at.append(0)
        for i in range(draft_len):
            self.drafted_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d


def merge(stats: list[SpecStats]) -> SpecStats:
    """Sum counters and times over sequences (e.g. a whole prompt set)."""
    out = SpecStats()
    for s in stats:
        for name in ("generated", "drafted", "accepted", "rejections", "bonus", "verifier_forwards", "prefill_tokens", "forced"):
            setattr(out, name, getattr(out, name) + getattr(s, name))
        for name in ("prefill_time", "decode_time", "draft_time", "verify_time"):
            setattr(out, name, getattr(out, name) + getattr(s, name))
        out.accepted_at = [a + b for a, b in _zip_longest(out.accepted_at, s.accepted_at)]
        out.drafted_at = [a + b for a, b in _zip_longest(out.drafted_at, s.drafted_at)]
    return out


def _zip_longest(a: list[int], b: list[int]):
    n = max(len(a), len(b))
    return zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))
