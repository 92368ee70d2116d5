"""Stable 64-bit mixing: the one hash family behind seeded ids and content keys.

Workloads derive token ids from (seed, key, offset), simulation draws stand-in tokens,
and metrics key prompt blocks; all need hashes that are the same in every process (unlike
``hash`` on ``str``) and fast on numpy arrays. SplitMix64's finaliser is the mixer
(uint64 arithmetic wraps mod 2**64, which is intended); blake2b keys text.
"""

from __future__ import annotations

import hashlib

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: SplitMix64's increment


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (a new array; wrapping intended). Pure."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def stable_key(text: str) -> int:
    """A 63-bit key of ``text`` that is the same in every process. Pure."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
