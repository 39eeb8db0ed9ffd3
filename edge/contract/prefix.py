"""What both sides of the node contract agree on about a prompt's prefix fingerprint
(`RunRequest.prefix_blocks`) and the KV-cache reports of a Watch stream.

The edge cuts one canonical rendering of a prompt into blocks of
PREFIX_BLOCK_CHARS characters and chains their hashes (`edge.api.fingerprint`);
a node that keeps its KV cache by those blocks (the simulated node's cache
model) reports the blocks it stores and evicts. Both sides count a block as
BLOCK_TOKENS tokens: CHARS_PER_TOKEN characters a token, the rule of thumb the
simulated node's cache model uses for a prompt's size.
"""

from __future__ import annotations

# Characters of the canonical rendering in one block; a partial last block is not hashed.
PREFIX_BLOCK_CHARS = 256
# The characters of a prompt taken as one token (the simulated node's rule).
CHARS_PER_TOKEN = 4
BLOCK_TOKENS = PREFIX_BLOCK_CHARS // CHARS_PER_TOKEN
# The blocks a RunRequest carries at most (a longer prompt: its first ones, 1 MiB).
MAX_PREFIX_BLOCKS = 4096
# The block hashes one Watch report carries at most (stored and evicted together):
# more changes than that since the last report are sent as a snapshot.
MAX_KV_BLOCKS_PER_REPORT = 65_536
