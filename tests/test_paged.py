"""The paged KV cache gives the logits of the dynamic cache, and sharing never changes what another sequence sees."""
import pytest
import torch

from toyllm import build_model
from toyllm.cache import DynamicKVCache, KVCache
from toyllm.generation import generate
from toyllm.paged import BlockPool, PagedKVCache
from toyllm.utils import random_prompt

pytestmark = pytest.mark.needs("8.1", "8.2")     # every paged cache runs both steps of lesson 08


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def _pool(model, n_blocks=64, block_size=4):
    return BlockPool.for_model(model.config, n_blocks, block_size)


def _run(model, cache, ids, chunks):
    """Feed ``ids`` in calls of the given sizes; the logits of every call, concatenated (1, T, vocab)."""
    out, start = [], 0
    for n in chunks:
        out.append(model(torch.tensor([ids[start:start + n]]), cache=cache))
        start += n
    return torch.cat(out, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("chunks", [[11], [5, 1, 1, 1, 7], [4, 4, 3]])      # calls crossing block ends, or not
def test_logits_equal_the_dynamic_cache(model, block_size, chunks):
    ids = random_prompt(sum(chunks), model.config.vocab_size, seed=1)
    want = _run(model, DynamicKVCache(model.config.n_layers), ids, chunks)
    got = _run(model, PagedKVCache(_pool(model, block_size=block_size)), ids, chunks)
    assert torch.equal(got, want)          # the same numbers, gathered from blocks: identical logits


@torch.no_grad()
def test_generate_with_a_paged_cache_gives_the_same_tokens(model):
    ids = random_prompt(9, model.config.vocab_size, seed=2)
    want = generate(model, ids, 12, cache="dynamic").output_ids
    assert generate(model, ids, 12, cache=PagedKVCache(_pool(model, block_size=4))).output_ids == want


@torch.no_grad()
def test_a_sequence_takes_blocks_only_as_it_grows(model):
    pool = _pool(model, n_blocks=8, block_size=4)
    cache = PagedKVCache(pool)
    _run(model, cache, random_prompt(9, model.config.vocab_size, seed=3), [9])
    assert cache.length == 9 and len(cache.table) == 3 and pool.used_blocks == 3
    assert cache.reserved_rows - cache.length == 3          # the unused tail of the last block
    cache.release()
    assert pool.used_blocks == 0 and cache.length == 0


@torch.no_grad()
def test_a_full_pool_says_so(model):
    cache = PagedKVCache(_pool(model, n_blocks=2, block_size=4))
    with pytest.raises(MemoryError, match="2 blocks of 4 tokens are all in use"):
        _run(model, cache, random_prompt(9, model.config.vocab_size, seed=3), [9])


@torch.no_grad()
def test_a_fork_copies_the_shared_block_before_writing_and_the_original_is_untouched(model):
    pool = _pool(model, block_size=4)
    ids = random_prompt(6, model.config.vocab_size, seed=4)           # 6 tokens: the second block is half full
    a = PagedKVCache(pool)
    _run(model, a, ids, [6])
    keys_before = [a.keys(i).clone() for i in range(model.config.n_layers)]
    b = a.fork()
    assert b.table == a.table and all(pool.refs[blk] == 2 for blk in a.table)
    b_out = model(torch.tensor([[7, 8]]), cache=b)
    assert b.table[0] == a.table[0] and b.table[1] != a.table[1]  # the full block stays shared, the written one is copied
    assert pool.refs[a.table[0]] == 2 and pool.refs[a.table[1]] == 1 and pool.refs[b.table[1]] == 1
    for i in range(model.config.n_layers):
        assert torch.equal(a.keys(i), keys_before[i])             # a still sees exactly its own 6 tokens
    want = _run(model, DynamicKVCache(model.config.n_layers), ids + [7, 8], [6, 2])[:, -2:]
    torch.testing.assert_close(b_out, want, rtol=0, atol=1e-6)


@torch.no_grad()
def test_a_block_still_shared_is_not_reused_when_one_user_releases_it(model):
    pool = _pool(model, n_blocks=6, block_size=4)
    ids = random_prompt(8, model.config.vocab_size, seed=5)
    a = PagedKVCache(pool)
    _run(model, a, ids, [8])
    b = a.fork()
    a.release()
    assert pool.used_blocks == 2                                   # b still holds both blocks
    c = PagedKVCache(pool)
    _run(model, c, random_prompt(8, model.config.vocab_size, seed=6), [8])
    assert not set(c.table) & set(b.table)
    want = _run(model, DynamicKVCache(model.config.n_layers), ids + [3], [8, 1])[:, -1:]
    torch.testing.assert_close(model(torch.tensor([[3]]), cache=b), want, rtol=0, atol=1e-6)


@torch.no_grad()
def test_a_prompt_with_a_known_prefix_reuses_its_blocks_and_computes_only_the_rest(model):
    pool = _pool(model, block_size=4)
    system = random_prompt(10, model.config.vocab_size, seed=7)
    first = PagedKVCache(pool)
    _run(model, first, system + [1, 2], [12])
    first.register_prompt(system + [1, 2])
    second_ids = system + [5, 6, 7]
    second = PagedKVCache.for_prompt(pool, second_ids)
    assert second.length == 8 and second.table == first.table[:2]     # two whole blocks of the system prompt
    logits = model(torch.tensor([second_ids[second.length:]]), cache=second)
    want = _run(model, DynamicKVCache(model.config.n_layers), second_ids, [len(second_ids)])
    torch.testing.assert_close(logits[:, -1], want[:, -1], rtol=0, atol=1e-5)
    first.release()
    system_blocks = second.table[:2]
    assert pool.prefix_blocks(second_ids) == system_blocks          # still held, and still found
    second.release()
    assert pool.used_blocks == 0 and pool.free_blocks == pool.n_blocks
    assert pool.prefix_blocks(second_ids) == system_blocks          # free, but its rows kept and findable
    third = PagedKVCache.for_prompt(pool, system + [9])
    assert third.table == system_blocks and third.length == 8
    logits = model(torch.tensor([(system + [9])[third.length:]]), cache=third)
    want = _run(model, DynamicKVCache(model.config.n_layers), system + [9], [11])
    torch.testing.assert_close(logits[:, -1], want[:, -1], rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_kept_prefix_gives_its_room_back_when_the_pool_needs_it(model):
    pool = _pool(model, n_blocks=4, block_size=4)
    system = random_prompt(8, model.config.vocab_size, seed=8)
    a = PagedKVCache(pool)
    _run(model, a, system + [1], [9])
    a.register_prompt(system + [1])
    a.release()
    assert pool.prefix_blocks(system + [2]) != []
    b = PagedKVCache(pool)
    _run(model, b, random_prompt(16, model.config.vocab_size, seed=9), [16])     # needs all four blocks
    assert pool.used_blocks == 4 and pool.prefix_blocks(system + [2]) == []   # the kept prefix was taken back


def test_bad_pools_and_batches_are_refused(model):
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockPool(4, 0, 2, 2, 8)
    cache = PagedKVCache(_pool(model))
    with pytest.raises(ValueError, match="batch 1"):
        cache.update(0, torch.zeros(2, model.config.n_kv_heads, 1, model.config.head_dim),
                     torch.zeros(2, model.config.n_kv_heads, 1, model.config.head_dim))


@torch.no_grad()
def test_a_paged_cache_counts_its_free_rows_and_generate_asks_it_before_any_work(model):
    ids = random_prompt(6, model.config.vocab_size, seed=2)
    cache = PagedKVCache(_pool(model, n_blocks=3, block_size=4))
    assert isinstance(cache, KVCache) and cache.batch_size == 1 and cache.free_tokens == 12
    model(torch.tensor([ids]), cache=cache)
    assert cache.free_tokens == 2 + 4                     # the rest of its second block, then the free one
    other = cache.fork()
    assert other.free_tokens == cache.free_tokens == 2    # the shared block is copied into the free one first
    with pytest.raises(ValueError, match="needs 25 free rows but the paged cache has 12"):
        generate(model, ids, 20, cache=PagedKVCache(_pool(model, n_blocks=3, block_size=4)))
    with pytest.raises(ValueError, match="the paged cache was built for batch 1, but prompt_ids has 2 prompts"):
        generate(model, [ids, ids], 2, cache=PagedKVCache(_pool(model)))
