"""API keys (`--api-key`, `--api-key-file`, FORERUN_API_KEY): who may call the /v1 routes,
and which tenant each caller is.

A request carries `Authorization: Bearer <key>` as OpenAI's clients send it; a missing or
wrong key is a 401 (vLLM guards /v1 the same way; /health and /metrics stay open for
probes and scrapers). Each key is a tenant: its hash is part of the prefix-cache salt and of
suffix decoding's store, so a tenant's cached blocks and earlier outputs never serve
another's requests. Without keys every caller is one tenant (the empty one), told apart
only by `cache_salt`.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from forerun.errors import ConfigError

GUARDED = ("/v1/", "/reset_prefix_cache")  # path prefixes that need a key when keys are set


@dataclass(frozen=True)
class ApiKeys:
    digests: frozenset[bytes] = frozenset()  # SHA-256 of each accepted key

    @classmethod
    def of(cls, keys: list[str] | tuple[str, ...] = (), files: list[str] | tuple[str, ...] = (),
           env: str | None = None) -> "ApiKeys":
        """Keys given on the command line, one per line in each file (blank lines and # comments
        skipped), and the environment's (FORERUN_API_KEY). An empty key is refused.
        >>> ApiKeys.of(["s3cret"]).tenant("Bearer s3cret") == ApiKeys.of(["s3cret"]).tenant("Bearer s3cret")
        True
        >>> ApiKeys.of(["s3cret"]).tenant("Bearer wrong") is None
        True
        """
        found = list(keys)
        for f in files:
            try:
                lines = Path(f).read_text(encoding="utf-8").splitlines()
            except OSError as e:
                raise ConfigError(f"--api-key-file {f}: cannot read it ({e.strerror or e})") from None
            except UnicodeDecodeError:
                raise ConfigError(f"--api-key-file {f}: not UTF-8 text (one key a line)") from None
            in_file = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
            if not in_file:  # else the server would run open while its operator believes it guarded
                raise ConfigError(f"--api-key-file {f}: no key in it (one key a line; blank lines and # comments skipped)")
            found += in_file
        if env is None:
            env = os.environ.get("FORERUN_API_KEY")
        if env:
            found.append(env)
        if any(not k.strip() for k in found):
            raise ConfigError("--api-key: an API key must not be empty")
        return cls(frozenset(_digest(k.strip()) for k in found))

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def tenant(self, authorization: str | None) -> bytes | None:
        """The caller's tenant (its key's digest) from the Authorization header; None: refused.
        Without keys, every caller is the empty tenant."""
        if not self.enabled:
            return b""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        d = _digest(key.strip())
        return d if any(hmac.compare_digest(d, known) for known in self.digests) else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def guarded(path: str) -> bool:
    return path.startswith(GUARDED)


def salt(tenant: bytes, cache_salt: str | None) -> bytes:
    """The prefix cache's and suffix store's key for a request: its tenant, then its cache_salt.
    >>> salt(b"", None), salt(b"", "x") != salt(b"t", "x")
    (b'', True)
    """
    if not tenant and not cache_salt:
        return b""
    return hashlib.sha256(tenant + b"|" + (cache_salt or "").encode()).digest()
