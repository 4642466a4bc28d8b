"""FreeBlockQueue: the intrusive O(1) doubly linked list of free KV blocks."""

import pytest

from nanokv.cache.block import FreeBlockQueue, KVCacheBlock


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def check_links(queue: FreeBlockQueue) -> None:
    """Forward and backward walks agree, and the counter matches."""
    forward = list(queue)
    backward = []
    block = queue._tail.prev_free
    while block is not queue._head:
        backward.append(block)
        block = block.prev_free
    assert forward == backward[::-1]
    assert len(forward) == len(queue) == queue.num_free_blocks
    for b in forward:
        assert queue.contains(b)


def make(n: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_initial_order_and_popleft():
    blocks, q = make(4)
    assert ids(q) == [0, 1, 2, 3]
    assert len(q) == 4
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert ids(q) == [2, 3]
    assert not q.contains(blocks[0])
    check_links(q)


def test_append_and_appendleft():
    _, q = make(4)
    a, b = q.popleft(), q.popleft()  # 0, 1
    q.append(a)  # back
    q.appendleft(b)  # front
    assert ids(q) == [1, 2, 3, 0]
    check_links(q)
    assert [q.popleft().block_id for _ in range(4)] == [1, 2, 3, 0]
    assert len(q) == 0
    check_links(q)


def test_remove_from_middle_front_back():
    blocks, q = make(5)
    q.remove(blocks[2])  # middle
    assert ids(q) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.remove(blocks[0])  # front
    q.remove(blocks[4])  # back
    assert ids(q) == [1, 3]
    check_links(q)
    q.append(blocks[2])
    q.appendleft(blocks[4])
    assert ids(q) == [4, 1, 3, 2]
    check_links(q)


def test_remove_touches_only_neighbours():
    """O(1) remove: the links of every block but the neighbours are poisoned, so any walk of
    the list would fail; removing from the middle must still work."""

    class Poison:
        def __getattr__(self, name):
            raise AssertionError("remove walked the free queue")

    blocks, q = make(10)
    for i in list(range(0, 4)) + list(range(7, 10)):
        blocks[i].next_free = blocks[i].prev_free = Poison()
    q.remove(blocks[5])
    assert blocks[4].next_free is blocks[6] and blocks[6].prev_free is blocks[4]
    assert len(q) == 9


def test_remove_patches_only_neighbours():
    blocks, q = make(6)
    q.remove(blocks[3])
    assert blocks[2].next_free is blocks[4]
    assert blocks[4].prev_free is blocks[2]
    check_links(q)


def test_double_insert_raises():
    blocks, q = make(3)
    with pytest.raises(RuntimeError):
        q.append(blocks[1])
    with pytest.raises(RuntimeError):
        q.appendleft(blocks[0])
    assert ids(q) == [0, 1, 2]
    check_links(q)
    with pytest.raises(RuntimeError):
        FreeBlockQueue([blocks[0]])  # a block already in another queue


def test_remove_non_member_raises():
    _, q = make(3)
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)
    with pytest.raises(RuntimeError):
        q.remove(KVCacheBlock(99))
    assert ids(q) == [1, 2]
    check_links(q)


def test_popleft_empty_raises():
    _, q = make(0)
    with pytest.raises(ValueError):
        q.popleft()
    blocks, q = make(1)
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    assert len(q) == 0
    q.append(blocks[0])
    assert q.popleft() is blocks[0]


def test_random_ops_against_list():
    import random
    rng = random.Random(0)
    blocks, q = make(30)
    model = list(blocks)
    outside = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.25 and model:
            b = q.popleft()
            assert b is model.pop(0)
            outside.append(b)
        elif op < 0.5 and model:
            b = rng.choice(model)
            q.remove(b)
            model.remove(b)
            outside.append(b)
        elif op < 0.75 and outside:
            b = outside.pop(rng.randrange(len(outside)))
            q.append(b)
            model.append(b)
        elif outside:
            b = outside.pop(rng.randrange(len(outside)))
            q.appendleft(b)
            model.insert(0, b)
        assert list(q) == model
        assert len(q) == len(model)
    check_links(q)
