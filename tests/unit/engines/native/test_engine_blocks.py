"""The KV-cache block allocator: free list, reference counts, and the prefix table with LRU eviction."""

from __future__ import annotations

import pytest

from hybridrl.engines.native.blocks import BlockAllocator, block_keys, image_runs
from hybridrl.errors import HybridRLError


def test_references_and_the_free_list():
    a = BlockAllocator(6)  # blocks 1..5; 0 is scratch
    x = a.allocate(2)
    assert x == [1, 2] and a.free == 3 and a.held == 2
    a.share(x, times=2)  # two more sequences read them
    a.release(x)
    a.release(x)
    assert a.free == 3  # one reference left each
    a.release(x)
    assert a.free == 5 and a.held == 0
    with pytest.raises(HybridRLError, match="released more often"):
        a.release([1])
    with pytest.raises(HybridRLError, match="6 blocks wanted, 5 free"):
        BlockAllocator(6).allocate(6)


def test_block_keys_chain_every_earlier_token():
    k = block_keys([1, 2, 3, 4, 5, 6, 7], 2, 3)
    assert k[0] == (0, (1, 2)) and k[1] == (hash(k[0]), (3, 4)) and k[2] == (hash(k[1]), (5, 6))
    # The same block of tokens after a different prefix has a different key.
    assert block_keys([9, 2, 3, 4], 2, 2)[1] != k[1]
    assert block_keys([1, 2, 3, 4, 5, 6, 7], 2, 3, start=1, parent=k[0]) == k[1:]


def test_image_blocks_key_on_the_pictures_content():
    IMG = 50
    tokens = [1, 2, 3, IMG, IMG, IMG, 4, 5, IMG, 6]  # blocks of 2: image "a" begins in block 1, "b" in block 4
    runs = image_runs(tokens, IMG, ["a", "b"])
    assert runs == [(3, 6, "a"), (8, 9, "b")]
    assert image_runs(tokens, IMG, ["a"]) == [(3, 6, "a")]  # placeholders past the last image are text
    keys = block_keys(tokens, 2, 5, images=runs)
    assert keys[:1] == block_keys(tokens, 2, 1)  # before any picture: a text prompt's keys
    assert keys[1] == (hash(keys[0]), (3, IMG), ("a",)) and keys[4] == (hash(keys[3]), (IMG, 6), ("b",))
    # Another first picture: every key from its block on differs, the blocks after it through the chain.
    other = block_keys(tokens, 2, 5, images=image_runs(tokens, IMG, ["c", "b"]))
    assert other[0] == keys[0] and all(o != k for o, k in zip(other[1:], keys[1:]))
    # Another second picture: the keys before its block stay, so a prompt adding a picture reuses the earlier ones.
    assert block_keys(tokens, 2, 5, images=image_runs(tokens, IMG, ["a", "c"]))[:4] == keys[:4]
    assert block_keys(tokens, 2, 5, start=2, parent=keys[1], images=runs) == keys[2:]


def test_prefix_table_matches_shares_and_evicts_least_recently_used():
    a = BlockAllocator(6)
    first, second = a.allocate(2), a.allocate(2)
    ka, kb = block_keys([1, 2, 3, 4], 2, 2), block_keys([7, 8, 9, 9], 2, 2)
    a.register(ka, first)
    a.register(kb, second)
    a.register(ka, second)  # a key already entered keeps its block
    assert a.cached == 4
    a.release(first)
    a.release(second)
    assert a.held == 0 and a.free == 5  # idle entries count as free: they can be evicted
    assert a.match(ka + block_keys([5, 6], 2, 1)) == first  # the longest run of known keys, now referenced
    assert a.match(block_keys([1, 9], 2, 1)) == []
    assert a.held == 2 and a.free == 3
    a.release(first)  # back in the table: most recently used now
    got = a.allocate(3)  # the free list has 1; two idle entries go, least recently used first: `second`'s
    assert sorted(got) == sorted([5] + second) and a.cached == 2
    assert a.match(kb) == [] and a.match(ka) == first
    a.forget_prefixes()  # new weights: nothing cached is valid
    assert a.cached == 0 and a.match(ka) == [] and a.held == 5
    a.release(first)
    a.release(got)
    assert a.free == 5 and a.held == 0


def test_extend_keeps_entries_and_references():
    a = BlockAllocator(3)
    x = a.allocate(2)
    a.register(block_keys([1, 2], 2, 1), x[:1])
    a.extend(6)
    assert a.free == 3 and a.held == 2 and a.cached == 1
    assert a.allocate(3) == [3, 4, 5]
