"""KV cache blocks and the O(1) free queue they live in."""

from __future__ import annotations


class KVCacheBlock:
    """Metadata of one physical block of the KV pool.

    `ref_cnt` counts the requests whose block table holds this block. `block_hash` is set while the
    block is registered in the prefix cache; `token_ids` and `extra_keys` are kept with it so a hit
    compares content, not only hashes (`content_id`: the id of the whole prefix it ends, in the
    block manager's prefix cache). `copy_of` is set instead of `block_hash` on a held block
    whose content another registered block already holds (the prefix cache keeps one block per
    hash; this copy takes over the hash when the registered one goes, `BlockManager`).
    `prev_free` / `next_free` link it into the free queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "extra_keys", "content_id",
                 "copy_of", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.extra_keys: tuple | None = None
        self.content_id: int | None = None
        self.copy_of: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.extra_keys = None
        self.content_id = None
        self.copy_of = None

    def __repr__(self) -> str:
        copy = "" if self.copy_of is None else f", copy of {self.copy_of}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash}{copy})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with sentinels.

    The front holds the blocks to reuse first; the back the most recently freed cached blocks (LRU
    order). Every operation is O(1) and allocates nothing.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the front
        self._tail = KVCacheBlock(-1)  # sentinel after the back
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block left in the KV pool")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
