"""Which KV-cache block holds what: a free list, reference counts, and a prefix table of blocks whose contents are
known by the tokens that produced them.

A sequence takes references to its blocks and drops them when it finishes; a block nobody references goes back to
the free list. Full blocks of prompts and of finished sequences are also entered in the prefix table under a key
chained over every token up to their end, ``key_i = (hash(key_{i-1}), tokens of block i)``, so a later request that
starts with the same tokens (the next turn of an agent loop, the other samples of a prompt) references them instead
of computing them again. A block where an image's placeholder tokens begin also keys on that image's content digest
(`image_runs`): equal placeholder tokens stand for any picture, and the chain carries the digest to every later
block. The table holds one reference of its own; blocks only it references are evicted, least
recently used first, when the free list runs dry. Weights changing makes every entry stale: `forget_prefixes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridrl.errors import HybridRLError

BlockKey = tuple
"""(hash of the previous block's key, the block's tokens[, digests of the images whose placeholders begin in it])."""


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    blocks: int,
    start: int = 0,
    parent: BlockKey | None = None,
    images: Sequence[tuple[int, int, str]] = (),
) -> list[BlockKey]:
    """Prefix-table keys of full blocks start..blocks-1 of `tokens` (`parent`: the key of block start - 1; `images`:
    the sequence's `image_runs`)."""
    keys: list[BlockKey] = []
    parent = hash(parent) if parent is not None else 0
    for i in range(start, blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        key: BlockKey = (parent, tuple(tokens[lo:hi]))
        if images:  # (a scan per block otherwise, for every text request's prompt)
            begun = tuple(digest for first, _, digest in images if lo <= first < hi)
            if begun:
                key += (begun,)
        keys.append(key)
        parent = hash(key)
    return keys


def image_runs(tokens: Sequence[int], image_token_id: int, digests: Sequence[str]) -> list[tuple[int, int, str]]:
    """(first, end, digest) of each image's placeholder tokens in `tokens`: the i-th run of `image_token_id` is the
    i-th image's (a processor writes each image's placeholders as one run between its start and end tokens). Runs
    past the last image (such a token generated as text) are not images."""
    runs: list[tuple[int, int, str]] = []
    i, n = 0, len(tokens)
    while i < n and len(runs) < len(digests):
        if tokens[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < n and tokens[j] == image_token_id:
            j += 1
        runs.append((i, j, digests[len(runs)]))
        i = j
    return runs


class BlockAllocator:
    """Free list, reference counts and prefix table of the blocks 1..num_blocks-1 (block 0 is scratch)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise HybridRLError(f"KV cache: {num_blocks} blocks is too few (block 0 is scratch)")
        self.num_blocks = num_blocks
        # Popped from the end: the lowest ids go first, so a small workload touches a compact region.
        self._free = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks
        self._table: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # in the table, referenced by nothing else; LRU first

    def extend(self, num_blocks: int) -> None:
        """Grow to `num_blocks` blocks (the pool grew; every entry and reference stays)."""
        self._free[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)
        self._refs += [0] * (num_blocks - self.num_blocks)
        self.num_blocks = num_blocks

    @property
    def free(self) -> int:
        """Blocks a request can have now: the free list plus the evictable table entries."""
        return len(self._free) + len(self._idle)

    @property
    def held(self) -> int:
        """Blocks some sequence references (the table's own references not counted)."""
        return self.num_blocks - 1 - len(self._free) - len(self._idle)

    @property
    def cached(self) -> int:
        """Blocks in the prefix table."""
        return len(self._key_of)

    def holders(self, block: int) -> int:
        """Sequences referencing `block` (the prefix table's own reference not counted)."""
        return self._refs[block] - (block in self._key_of)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with one reference (evicting idle table entries when the free list is short)."""
        if n > self.free:
            raise HybridRLError(f"KV cache: {n} blocks wanted, {self.free} free")
        while len(self._free) < n:
            self._evict(next(iter(self._idle)))
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: Sequence[int], times: int = 1) -> None:
        """Add `times` references to each of `blocks` (more sequences read them)."""
        for b in blocks:
            self._refs[b] += times
            self._idle.pop(b, None)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of `blocks`; a block with none left goes back to the free list."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] == 1 and b in self._key_of:
                self._idle[b] = None
            elif self._refs[b] < 0:
                raise HybridRLError(f"KV cache: block {b} released more often than taken")

    # -- the prefix table ----------------------------------------------------------------------------------
    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks of the longest run of `keys` in the table, each with a new reference for the caller."""
        out: list[int] = []
        for key in keys:
            block = self._table.get(key)
            if block is None:
                break
            out.append(block)
        self.share(out)  # referenced again: out of the eviction order until released (then most recently used)
        return out

    def register(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> None:
        """Enter full blocks whose K/V are final under their keys (the caller still holds its references).
        A key already in the table keeps its block."""
        for key, b in zip(keys, blocks):
            if b in self._key_of or key in self._table:  # (the block first: a key's lookup hashes all its tokens)
                continue
            self._table[key] = b
            self._key_of[b] = key
            self._refs[b] += 1

    def forget_prefixes(self) -> None:
        """Empty the prefix table (the weights changed: every cached K/V is stale)."""
        for b in list(self._key_of):
            del self._table[self._key_of.pop(b)]
            self._idle.pop(b, None)
            self.release([b])

    def _evict(self, b: int) -> None:
        del self._table[self._key_of.pop(b)]
        del self._idle[b]
        self.release([b])
