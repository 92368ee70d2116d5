"""Block keys have one definition (kvbench.hashing): the engine's per-sequence key chain and
the many-prompt keying of the prefix-reuse bound and ``kvbench trace inspect`` agree."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.engines.kv.token_ids import ArrayTokenIds, KeyedTokenIds
from kvbench.hashing import prompt_block_keys


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_many_prompt_keys_equal_the_engine_key_chains(block_size):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 50_000, size=n) for n in (0, 3, 17, 64, 130)]
    prompts.append(np.concatenate([prompts[3], prompts[2]]))  # shares a prefix with an earlier prompt
    salts = [None, "a", None, "tenant-1", None, "tenant-1"]
    parts, firsts, expected, total = [], [], [], 0
    for prompt, salt in zip(prompts, salts):
        num_blocks = len(prompt) // block_size
        tokens = ArrayTokenIds(prompt) if len(prompt) % 2 else KeyedTokenIds(prompt)
        chain = tokens.chain(block_size, salt)
        chain.extend(tokens, num_blocks)
        if num_blocks:
            parts.append(prompt[: num_blocks * block_size])
            firsts.append(total)
            total += num_blocks
            expected.extend(chain.hashes.tolist())
    used_salts = [salt for prompt, salt in zip(prompts, salts) if len(prompt) // block_size]
    keys = prompt_block_keys(parts, firsts, used_salts, block_size)
    assert keys.dtype == np.uint64 and keys.tolist() == expected
