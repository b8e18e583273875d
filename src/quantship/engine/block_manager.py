"""Which cache blocks each sequence owns, and prefix caching by chained hashes of full blocks.

A full block's hash covers its tokens and, through the previous block's hash, everything before
it, so equal hashes mean equal prefixes. Freed blocks keep their contents and stay findable until
they are reused (least recently freed first), which is what makes a repeated system prompt cheap.
"""

from __future__ import annotations

from collections import OrderedDict

from quantship.engine.sequence import Sequence


def block_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
    return hash((previous, tokens))  # ints and tuples hash the same in every process


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash → block holding that prefix
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # reuse from the front
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> None:
        """Share the cached blocks of the longest cached prefix; always leave one token to compute."""
        if not self.prefix_caching or seq.block_table:
            return
        previous = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(previous, tokens)
            block = self.cached.get(h)
            if block is None or self.tokens_of[block] != tokens:
                break
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            previous = h
        seq.num_computed = len(seq.block_table) * self.block_size

    def count_lookup(self, seq: Sequence) -> None:
        """Once per admission (not per failed attempt to find blocks): tokens asked for, tokens found."""
        if self.prefix_caching:
            self.queries += seq.num_tokens
            self.hits += seq.num_computed

    def allocate(self, seq: Sequence, tokens: int) -> bool:
        """Grow seq's block table to hold `tokens` tokens; False (and no change) when blocks run out."""
        need = self.blocks_for(tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            if self.hash_of[block] is not None and self.cached.get(self.hash_of[block]) == block:
                del self.cached[self.hash_of[block]]
            self.hash_of[block] = self.tokens_of[block] = None
            self.ref_count[block] = 1
            seq.block_table.append(block)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the blocks that this step filled findable by later requests."""
        if not self.prefix_caching:
            return
        while len(seq.block_hashes) < seq.num_computed // self.block_size:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block], self.tokens_of[block] = h, tokens

    def release(self, seq: Sequence) -> None:
        """Give back seq's blocks. Tail blocks are queued for reuse before head blocks, which are
        the ones other requests are most likely to share."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.hash_of[block] is None:
                    self.free.move_to_end(block, last=False)  # holds nothing findable: reuse first
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and the hit counters (after a warm-up request, say)."""
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        self.tokens_of = [None] * self.num_blocks
        self.queries = self.hits = 0

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
