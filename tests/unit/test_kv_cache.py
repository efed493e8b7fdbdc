"""CPU tests for engine/kv_cache.py against a brute-force oracle and a simulated K/V store."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from engine.kv_cache import KVCacheError, KVCacheManager


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Oracle:
    """Independent model: expected contents per sequence, plus a fake K/V store (one int per
    slot) that receives every write through `slot_mapping`. If two live sequences ever alias a
    written slot, their read-back contents diverge from the expectation."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.bs = mgr.block_size
        self.store = [-1] * (mgr.num_blocks * mgr.block_size)
        self.tokens: dict[int, list[int]] = {}
        self.counter = 0

    def write(self, seq: int, start: int, end: int) -> None:
        vals = list(range(self.counter, self.counter + end - start))
        self.counter += end - start
        for slot, v in zip(self.mgr.slot_mapping(seq, start, end), vals, strict=True):
            self.store[slot] = v
        self.tokens[seq][start:end] = vals

    def check(self) -> None:
        mgr = self.mgr
        mgr.check_integrity()
        refs: Counter[int] = Counter()
        for seq, toks in self.tokens.items():
            assert mgr.has(seq)
            assert mgr.num_tokens(seq) == len(toks)
            table = mgr.block_table(seq)
            assert len(table) == cdiv(len(toks), self.bs)
            refs.update(table)
            slots = mgr.slot_mapping(seq, 0, len(toks))
            assert [self.store[s] for s in slots] == toks, f"seq {seq} contents corrupted"
        for b in range(mgr.num_blocks):
            assert mgr.pool.ref_cnt(b) == refs[b]
        assert mgr.num_used_blocks == len(refs)
        assert mgr.num_free_blocks == mgr.num_blocks - len(refs)
        assert set(mgr.pool.free_queue()) == set(range(mgr.num_blocks)) - set(refs)


def shared_partial_tail(mgr: KVCacheManager, seq: int, n: int) -> bool:
    if n % mgr.block_size == 0:
        return False
    return mgr.pool.ref_cnt(mgr.block_table(seq)[n // mgr.block_size]) > 1


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_ops_against_oracle(block_size: int, seed: int) -> None:
    rng = random.Random(seed * 1000 + block_size)
    num_blocks = 48 if block_size > 1 else 160
    mgr = KVCacheManager(num_blocks, block_size)
    orc = Oracle(mgr)
    max_len = 6 * block_size if block_size > 1 else 40
    next_id = 0
    for _ in range(2500):
        seqs = list(orc.tokens)
        op = rng.choice(["new", "grow", "grow", "truncate", "truncate", "free", "spec"])
        if op == "new" or not seqs:
            n = rng.randint(0, max_len)
            free_before = mgr.num_free_blocks
            ok = mgr.allocate_slots(next_id, n)
            assert ok == (cdiv(n, block_size) <= free_before)
            if ok:
                orc.tokens[next_id] = []
                orc.write(next_id, 0, n)
                assert mgr.num_free_blocks == free_before - cdiv(n, block_size)
            else:
                assert not mgr.has(next_id) and mgr.num_free_blocks == free_before
            next_id += 1
        elif op in ("grow", "spec"):
            seq = rng.choice(seqs)
            old = len(orc.tokens[seq])
            n = old + rng.randint(0, 2 * block_size + 3)
            need = cdiv(n, block_size) - len(mgr.block_table(seq))
            assert mgr.num_blocks_needed(seq, n) == need
            assert mgr.can_allocate(seq, n) == (need <= mgr.num_free_blocks)
            free_before, table_before = mgr.num_free_blocks, mgr.block_table(seq)
            if mgr.allocate_slots(seq, n):
                assert mgr.num_free_blocks == free_before - need
                assert mgr.block_table(seq)[: len(table_before)] == table_before
                orc.write(seq, old, n)
                if op == "spec":  # drafts written, then roll back to an accepted prefix
                    accepted = rng.randint(old, n)
                    if not shared_partial_tail(mgr, seq, accepted):
                        mgr.truncate(seq, accepted)
                        del orc.tokens[seq][accepted:]
            else:
                assert need > free_before
                assert mgr.num_free_blocks == free_before
                assert mgr.block_table(seq) == table_before and mgr.num_tokens(seq) == old
        elif op == "truncate":
            seq = rng.choice(seqs)
            n = rng.randint(0, len(orc.tokens[seq]))
            if shared_partial_tail(mgr, seq, n):
                before = mgr.block_table(seq)
                with pytest.raises(KVCacheError):
                    mgr.truncate(seq, n)
                assert mgr.block_table(seq) == before
            else:
                mgr.truncate(seq, n)
                del orc.tokens[seq][n:]
        else:
            seq = rng.choice(seqs)
            mgr.free(seq)
            del orc.tokens[seq]
        orc.check()
    for seq in list(orc.tokens):
        mgr.free(seq)
        del orc.tokens[seq]
        orc.check()
    assert mgr.num_free_blocks == num_blocks and mgr.num_used_blocks == 0
    assert sorted(mgr.pool.free_queue()) == list(range(num_blocks))


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_slot_mapping_arithmetic(block_size: int) -> None:
    mgr = KVCacheManager(64, block_size)
    assert mgr.allocate_slots("a", 1)  # interleave so tables are not contiguous
    assert mgr.allocate_slots("b", 3 * block_size + 1)
    assert mgr.allocate_slots("a", 2 * block_size + 5)
    for seq in ("a", "b"):
        table, n = mgr.block_table(seq), mgr.num_tokens(seq)
        want = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        assert mgr.slot_mapping(seq, 0, n) == want
        for start in range(n + 1):
            end = min(n, start + block_size + 2)
            assert mgr.slot_mapping(seq, start, end) == want[start:end]
        with pytest.raises(KVCacheError):
            mgr.slot_mapping(seq, 0, n + 1)
        with pytest.raises(KVCacheError):
            mgr.slot_mapping(seq, -1, 1)
    with pytest.raises(KVCacheError):
        mgr.slot_mapping("nope", 0, 0)


def test_allocation_all_or_nothing() -> None:
    mgr = KVCacheManager(4, 16)
    assert mgr.allocate_slots("a", 33)  # 3 blocks
    assert not mgr.can_allocate("b", 17)
    assert not mgr.allocate_slots("b", 17)
    assert not mgr.has("b") and mgr.num_free_blocks == 1
    assert not mgr.allocate_slots("a", 65)  # needs 2 more, 1 free
    assert mgr.num_tokens("a") == 33 and len(mgr.block_table("a")) == 3
    assert mgr.allocate_slots("a", 48)  # fits in the current 3 blocks
    assert mgr.num_free_blocks == 1 and mgr.num_tokens("a") == 48
    assert mgr.allocate_slots("a", 10)  # never shrinks
    assert mgr.num_tokens("a") == 48
    assert mgr.allocate_slots("b", 16) and mgr.num_free_blocks == 0
    assert mgr.allocate_slots("c", 0) and mgr.block_table("c") == []
    mgr.check_integrity()


def test_free_queue_fifo_tail_first() -> None:
    mgr = KVCacheManager(6, 4)
    assert mgr.allocate_slots("a", 8) and mgr.block_table("a") == [0, 1]
    assert mgr.allocate_slots("b", 8) and mgr.block_table("b") == [2, 3]
    mgr.free("a")
    mgr.truncate("b", 4)
    assert mgr.pool.free_queue() == [4, 5, 1, 0, 3]
    assert mgr.allocate_slots("c", 20)
    assert mgr.block_table("c") == [4, 5, 1, 0, 3]


def test_conformance_vectors() -> None:
    """fms-extras' paged-cache metadata vectors, with our allocation order (ascending, not 99,
    98, ...)."""
    mgr = KVCacheManager(100, 16)
    for i, n in enumerate([5, 18, 40]):
        assert mgr.allocate_slots(i, n)
    assert mgr.num_used_blocks == 6
    assert [mgr.block_table(i) for i in range(3)] == [[0], [1, 2], [3, 4, 5]]
    assert mgr.slot_mapping(0, 0, 5) == list(range(5))
    for i, extra in enumerate([12, 1, 1]):
        assert mgr.allocate_slots(i, mgr.num_tokens(i) + extra)
    assert [mgr.num_tokens(i) for i in range(3)] == [17, 19, 41]
    assert mgr.slot_mapping(0, 5, 17) == [*range(5, 16), 6 * 16]
    assert mgr.num_used_blocks == 7


def test_truncate_releases_blocks() -> None:
    mgr = KVCacheManager(8, 16, enable_prefix_caching=True)
    assert mgr.allocate_slots("a", 70)  # 5 blocks
    mgr.truncate("a", 33)
    assert len(mgr.block_table("a")) == 3 and mgr.num_free_blocks == 5
    mgr.truncate("a", 32)  # exactly 2 blocks: no empty tail block kept (fms B9)
    assert len(mgr.block_table("a")) == 2
    mgr.truncate("a", 0)
    assert mgr.has("a") and mgr.block_table("a") == [] and mgr.num_free_blocks == 8
    with pytest.raises(KVCacheError):
        mgr.truncate("a", 1)
    assert mgr.allocate_slots("b", 40)
    mgr.cache_computed_blocks("b", list(range(40)))
    assert mgr.allocate_cached_prefix("c", list(range(33))) == 32  # shares b's 2 full blocks
    with pytest.raises(KVCacheError):
        mgr.truncate("c", 20)  # would make shared block partly filled
    mgr.truncate("c", 16)
    assert mgr.pool.ref_cnt(mgr.block_table("b")[1]) == 1
    mgr.truncate("b", 36)  # into its own, unshared third block
    mgr.check_integrity()


def test_spec_decode_steps_do_not_leak() -> None:
    """fms B1 regression: after every step, used blocks == what the accepted tokens need."""
    rng = random.Random(7)
    bs, k = 16, 4
    mgr = KVCacheManager(64, bs)
    assert mgr.allocate_slots("s", 21)
    cur = "s"
    for _ in range(300):
        n = mgr.num_tokens(cur)
        assert mgr.allocate_slots(cur, n + k + 1)  # draft slots on the sequence itself
        mgr.truncate(cur, n + rng.randint(1, k + 1))  # roll back to the accepted prefix
        if mgr.num_tokens(cur) > 600:
            mgr.truncate(cur, 21)
        assert mgr.num_used_blocks == cdiv(mgr.num_tokens(cur), bs)
        mgr.check_integrity()
    mgr.free(cur)
    assert mgr.num_free_blocks == 64


def _fresh() -> KVCacheManager:
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert mgr.allocate_slots("a", 10)  # 3 blocks, last partial
    assert mgr.allocate_slots("b", 4)
    mgr.cache_computed_blocks("a", list(range(10)))
    assert mgr.allocate_cached_prefix("c", list(range(9))) == 8  # a's first 2 (full) blocks
    mgr.check_integrity()
    return mgr


def _corrupt_ref(m: KVCacheManager) -> None:
    m.pool._ref_cnt[m.block_table("b")[0]] += 1


def _leak(m: KVCacheManager) -> None:
    m.pool._free_queue.popitem(last=False)


def _free_but_used(m: KVCacheManager) -> None:
    m.pool._free_queue[m.block_table("b")[0]] = None


def _twice_in_table(m: KVCacheManager) -> None:
    b = m.block_table("a")[0]
    m._tables["a"].append(b)
    m._num_tokens["a"] = 16
    m.pool._ref_cnt[b] += 1


def _length_mismatch(m: KVCacheManager) -> None:
    m._num_tokens["b"] = 5


def _shared_partial(m: KVCacheManager) -> None:
    m._tables["c"].append(m.block_table("a")[2])  # a's partial tail, not a copy
    m._num_tokens["c"] = 9
    m.pool._ref_cnt[m.block_table("a")[2]] += 1


def _bad_block_id(m: KVCacheManager) -> None:
    m._tables["b"][0] = 99


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (_corrupt_ref, "ref_cnt 2, held by 1"),
        (_leak, "ref_cnt 0, held by 0|free .* != 8"),
        (_free_but_used, "in the free queue but referenced"),
        (_twice_in_table, "twice"),
        (_length_mismatch, "1 blocks for 5 tokens"),
        (_shared_partial, "not full"),
        (_bad_block_id, "out of range"),
    ],
)
def test_integrity_detects_corruption(tamper: Callable[[KVCacheManager], None], match: str) -> None:
    mgr = _fresh()
    tamper(mgr)
    with pytest.raises(KVCacheError, match=match):
        mgr.check_integrity()


def test_misuse_raises() -> None:
    mgr = KVCacheManager(4, 16)
    for call in (
        lambda: mgr.free("x"),
        lambda: mgr.block_table("x"),
        lambda: mgr.num_tokens("x"),
        lambda: mgr.truncate("x", 0),
        lambda: mgr.num_blocks_needed("x", -1),
    ):
        with pytest.raises(KVCacheError):
            call()
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    assert (mgr.num_blocks, mgr.block_size, mgr.num_used_blocks) == (4, 16, 0)


def test_prefix_cache_shares_whole_computed_blocks_until_they_are_reused() -> None:
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(10, 20))  # 10 tokens: blocks [10..13], [14..17], partial [18, 19]
    assert mgr.allocate_cached_prefix("a", prompt) == 0 and not mgr.has("a")
    assert mgr.allocate_slots("a", 10)
    mgr.cache_computed_blocks("a", prompt[:6])  # a chunk: only the first block is complete
    mgr.cache_computed_blocks("a", prompt)
    a_table = mgr.block_table("a")

    # the same prompt shares both full blocks; the partial one is never shared
    assert mgr.allocate_cached_prefix("b", prompt) == 8
    assert mgr.block_table("b") == a_table[:2] and mgr.pool.ref_cnt(a_table[0]) == 2
    # at least one token stays to compute: an 8-token prompt reuses one block, not two
    assert mgr.allocate_cached_prefix("c", prompt[:8]) == 4
    # the digest covers the whole prefix: the same second block after another first misses
    assert mgr.allocate_cached_prefix("d", [99, 98, 97, 96, *prompt[4:]]) == 0
    mgr.check_integrity()

    for seq in ("a", "b", "c"):
        mgr.free(seq)
    assert mgr.num_used_blocks == 0
    assert mgr.allocate_cached_prefix("e", prompt) == 8  # kept while free
    assert mgr.block_table("e") == a_table[:2] and mgr.num_used_blocks == 2
    mgr.free("e")
    assert mgr.allocate_slots("f", 8 * 4)  # every block handed out again: the cache is gone
    mgr.free("f")
    assert mgr.allocate_cached_prefix("g", prompt) == 0
    assert mgr.num_prefix_hit_tokens == 8 + 4 + 8
    mgr.check_integrity()


def test_prefix_cache_off_registers_nothing() -> None:
    mgr = KVCacheManager(8, 4)
    assert mgr.allocate_slots("a", 9)
    mgr.cache_computed_blocks("a", list(range(9)))
    assert mgr.allocate_cached_prefix("b", list(range(9))) == 0 and not mgr.has("b")
