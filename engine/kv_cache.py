"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-sequence block tables.

Pure Python; the K/V tensors live with the model runner, which maps token position `p` of a
sequence to the physical slot `block_table[p // block_size] * block_size + p % block_size`.

Sharing invariant: a block held by more than one block table is always *full* for every
holder, so a write (which only ever goes to positions >= the writer's `num_tokens`) can never land
in a shared block. Only prefix caching shares blocks, and it shares full blocks only; `truncate`
refuses to cut into a shared block (it would make it partial), see its docstring.

Prefix caching (optional): a full block of prompt tokens, once computed, is registered under a
SHA-256 digest chained over every token before it (so equal digests mean equal prefixes, and a
crafted prompt cannot collide into another user's blocks), starting from the sequence's salt
(empty, or the key of its prompt-tuning prefix, whose placeholder ids are not its content). A
new sequence whose prompt starts with registered blocks takes them (`allocate_cached_prefix`)
instead of recomputing them. A registered block stays registered while free, until the free
queue hands it out again (least recently freed first), so free + used == total still holds and
cached blocks cost nothing.
Only blocks the caller declares computed are registered; drafts never are.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

SeqId = Hashable


class KVCacheError(Exception):
    """Misuse of the cache (unknown or duplicate sequence, bad length) or a
    failed integrity check."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Blocks `0..num_blocks-1`, a reference count per block, and a free queue.

    The free queue holds exactly the blocks with `ref_cnt == 0`, in the order they were freed;
    `allocate` takes from the front, so the least recently freed block is reused first (the
    eviction order a future prefix cache wants). It is an `OrderedDict` so that such a cache can
    also pull a freed-but-cached block out of the middle in O(1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def free_queue(self) -> list[int]:
        """The free blocks, next-to-be-allocated first (a copy)."""
        return list(self._free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue, each with `ref_cnt` 1.
        All-or-nothing: raises KVCacheError (allocating nothing) if fewer than `n` are free."""
        if n > len(self._free_queue):
            raise KVCacheError(f"need {n} blocks, {len(self._free_queue)} free")
        blocks = [self._free_queue.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._ref_cnt[b] = 1
        return blocks

    def take(self, block_id: int) -> None:
        """Reference `block_id`: +1 if used, else pulled out of the free queue with ref_cnt 1."""
        if self._ref_cnt[block_id] == 0:
            del self._free_queue[block_id]
        self._ref_cnt[block_id] += 1

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each (already referenced) block."""
        for b in blocks:
            assert self._ref_cnt[b] > 0, f"incref of free block {b}"
            self._ref_cnt[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in order; a block reaching 0 is appended to the
        free queue. Callers pass tail blocks first, so they are reused before prefix blocks."""
        for b in blocks:
            if self._ref_cnt[b] <= 0:
                raise KVCacheError(f"release of free block {b}")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free_queue[b] = None


class KVCacheManager:
    """Per-sequence block tables over a `BlockPool`.

    Each sequence has a declared length `num_tokens` (its capacity: positions `0..num_tokens-1`
    have slots) and a block table of exactly `ceil(num_tokens / block_size)` blocks: never an
    empty tail block. Growing (`allocate_slots`) and shrinking (`truncate`) cost O(blocks
    changed), so speculative decoding can allocate draft slots and truncate back every step.
    Blocks are shared only through prefix caching; see the module docstring for the rule.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self._block_size = block_size
        self._tables: dict[SeqId, list[int]] = {}
        self._num_tokens: dict[SeqId, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._digest_block: dict[bytes, int] = {}  # registered prefix digest -> block
        self._block_digest: dict[int, bytes] = {}
        self._num_hashed: dict[SeqId, tuple[int, bytes]] = {}  # blocks registered, last digest
        self.num_prefix_hit_tokens = 0
        """Prompt tokens taken from the prefix cache instead of computed, since start."""

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def _table(self, seq_id: SeqId) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KVCacheError(f"unknown sequence {seq_id!r}") from None

    def num_tokens(self, seq_id: SeqId) -> int:
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block table (logical block i -> physical block)."""
        return list(self._table(seq_id))

    def num_blocks_needed(self, seq_id: SeqId, num_tokens: int) -> int:
        """Extra blocks `seq_id` (new or existing) needs to hold `num_tokens` tokens in total."""
        if num_tokens < 0:
            raise KVCacheError(f"negative num_tokens {num_tokens}")
        have = len(self._tables.get(seq_id, ()))
        return max(0, _cdiv(num_tokens, self._block_size) - have)

    def can_allocate(self, seq_id: SeqId, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Ensure `seq_id` (registered if new) has slots for `num_tokens` tokens in total and set
        its length to `max(current, num_tokens)`; never shrinks (use `truncate`).

        All-or-nothing: if too few blocks are free, changes nothing (a new sequence is not
        registered) and returns False. New positions never fall in a shared block (invariant).
        """
        n_new = self.num_blocks_needed(seq_id, num_tokens)
        if n_new > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(seq_id, [])
        if n_new:
            table.extend(self._allocate_blocks(n_new))
        self._num_tokens[seq_id] = max(self._num_tokens.get(seq_id, 0), num_tokens)
        return True

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slots of positions `start..end-1`; requires `0 <= start <= end <= num_tokens(seq)`."""
        table = self._table(seq_id)
        if not 0 <= start <= end <= self._num_tokens[seq_id]:
            raise KVCacheError(
                f"positions [{start}, {end}) outside [0, {self._num_tokens[seq_id]}) of {seq_id!r}"
            )
        bs = self._block_size
        slots: list[int] = []
        p = start
        while p < end:  # one range per block touched, not one Python step per token
            base = table[p // bs] * bs
            stop = min(end, (p // bs + 1) * bs)
            slots.extend(range(base + p % bs, base + p % bs + (stop - p)))
            p = stop
        return slots

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink `seq_id` to `num_tokens` tokens, releasing the tail blocks it no longer needs.

        Raises KVCacheError (changing nothing) if `num_tokens` exceeds the current length, or if
        the new last block would be partly filled while shared with another sequence: later
        writes there would corrupt the other holder. Truncate to a block boundary, or free and
        reallocate, instead. The sequence stays registered even at 0 tokens.
        """
        table = self._table(seq_id)
        if not 0 <= num_tokens <= self._num_tokens[seq_id]:
            raise KVCacheError(
                f"cannot truncate {seq_id!r} from {self._num_tokens[seq_id]} to {num_tokens}"
            )
        keep = _cdiv(num_tokens, self._block_size)
        if num_tokens % self._block_size and self.pool.ref_cnt(table[keep - 1]) > 1:
            raise KVCacheError(
                f"truncating {seq_id!r} to {num_tokens} would leave shared block "
                f"{table[keep - 1]} partly filled"
            )
        if keep < len(table):
            self.pool.release(reversed(table[keep:]))
            del table[keep:]
        self._num_tokens[seq_id] = num_tokens

    def free(self, seq_id: SeqId) -> None:
        """Forget `seq_id` and drop its references; blocks reaching ref_cnt 0 join the free queue,
        tail first."""
        table = self._table(seq_id)
        self.pool.release(reversed(table))
        del self._tables[seq_id], self._num_tokens[seq_id]
        self._num_hashed.pop(seq_id, None)

    def _allocate_blocks(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        for b in blocks:  # reused: whatever prefix it held is gone
            digest = self._block_digest.pop(b, None)
            if digest is not None:
                del self._digest_block[digest]
        return blocks

    def _digest(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()

    def allocate_cached_prefix(
        self, seq_id: SeqId, token_ids: Sequence[int], salt: bytes = b""
    ) -> int:
        """Register the new sequence `seq_id` holding the longest registered prefix of
        `token_ids` in whole blocks, leaving at least one token of `token_ids` uncached (the
        model must compute it to sample the next). Returns the number of tokens it holds (0,
        and nothing registered, without a hit or with prefix caching off).

        `salt` starts the digest chain: only sequences with equal salts share blocks (a prompt
        prefix's key, whose placeholder token ids stand for different embeddings). The same
        salt must be given to `cache_computed_blocks` for this sequence."""
        if seq_id in self._tables:
            raise KVCacheError(f"sequence {seq_id!r} already exists")
        if not self.enable_prefix_caching:
            return 0
        bs, digest = self._block_size, salt
        blocks: list[int] = []
        for i in range((len(token_ids) - 1) // bs):
            digest = self._digest(digest, token_ids[i * bs : (i + 1) * bs])
            block = self._digest_block.get(digest)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return 0
        for b in blocks:
            self.pool.take(b)
        self._tables[seq_id] = blocks
        self._num_tokens[seq_id] = len(blocks) * bs
        self._num_hashed[seq_id] = (len(blocks), self._block_digest[blocks[-1]])
        self.num_prefix_hit_tokens += len(blocks) * bs
        return len(blocks) * bs

    def cache_computed_blocks(
        self, seq_id: SeqId, token_ids: Sequence[int], salt: bytes = b""
    ) -> None:
        """Register the full blocks of `seq_id` that hold `token_ids` (its first tokens, whose
        K/V are computed) for later sequences to share, under digests chained from `salt` (see
        `allocate_cached_prefix`). A no-op with prefix caching off."""
        if not self.enable_prefix_caching:
            return
        table, bs = self._table(seq_id), self._block_size
        done, digest = self._num_hashed.get(seq_id, (0, salt))
        n_full = min(len(token_ids) // bs, len(table))
        for i in range(done, n_full):
            digest = self._digest(digest, token_ids[i * bs : (i + 1) * bs])
            block = table[i]
            if digest not in self._digest_block and block not in self._block_digest:
                self._digest_block[digest] = block
                self._block_digest[block] = digest
        if n_full > done:
            self._num_hashed[seq_id] = (n_full, digest)

    def check_integrity(self) -> None:
        """Raise KVCacheError unless: every block is either free (ref_cnt 0, in the free queue
        once) or used (ref_cnt = number of tables holding it), so free + used == total; no table
        holds a block twice; each table has exactly ceil(num_tokens / block_size) blocks; and
        every block with ref_cnt > 1 is full for each holder. O(blocks + table entries)."""
        bs, pool = self._block_size, self.pool
        expected = [0] * pool.num_blocks
        for seq_id, table in self._tables.items():
            n = self._num_tokens.get(seq_id)
            if n is None or len(table) != _cdiv(n, bs):
                raise KVCacheError(f"{seq_id!r}: {len(table)} blocks for {n} tokens")
            if len(set(table)) != len(table):
                raise KVCacheError(f"{seq_id!r}: block twice in one table {table}")
            for b in table:
                if not 0 <= b < pool.num_blocks:
                    raise KVCacheError(f"{seq_id!r}: block id {b} out of range")
                expected[b] += 1
        if self._num_tokens.keys() != self._tables.keys():
            raise KVCacheError("num_tokens and block tables disagree on sequence ids")
        free = list(pool._free_queue)
        if len(set(free)) != len(free):
            raise KVCacheError("duplicate block in the free queue")
        for b in free:
            if not 0 <= b < pool.num_blocks or expected[b] or pool._ref_cnt[b]:
                raise KVCacheError(f"block {b} is in the free queue but referenced")
        for b, (want, got) in enumerate(zip(expected, pool._ref_cnt, strict=True)):
            if want != got:
                raise KVCacheError(f"block {b}: ref_cnt {got}, held by {want} tables")
        num_used = sum(1 for c in expected if c)
        if len(free) + num_used != pool.num_blocks:
            raise KVCacheError(f"free {len(free)} + used {num_used} != {pool.num_blocks} blocks")
        for seq_id, table in self._tables.items():
            n_full = self._num_tokens[seq_id] // bs
            for b in table[n_full:]:
                if expected[b] > 1:
                    raise KVCacheError(f"{seq_id!r}: shared block {b} is not full")
                if b in self._block_digest:
                    raise KVCacheError(f"{seq_id!r}: cached block {b} is not full")
        if {b: d for d, b in self._digest_block.items()} != self._block_digest:
            raise KVCacheError("prefix cache digest maps disagree")
