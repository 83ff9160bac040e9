#!/usr/bin/env python3
"""Replays a `kv-indexer simulate --ops-out` op log through an independent
Python model of vLLM v1's prefix cache, and checks every admit's
`hit_blocks` against it.

The model re-states, function by function, what vLLM's
`vllm/v1/core/kv_cache_utils.py` (`FreeKVCacheBlockQueue`),
`block_pool.py` (`BlockPool`), `single_type_kv_cache_manager.py`
(`FullAttentionManager`) and `kv_cache_manager.py` (`KVCacheManager`) do for
one full-attention group, without LoRA, multimodal inputs or speculative
tokens: it is written separately from the Rust pod model so that a mistake
in one is not copied into the other. Installing vLLM itself needs torch
(gigabytes); this runs on the standard library.

Usage: vllm_replay.py OPS.jsonl  -> exit 0 and "N admits match", or exit 1
with the first mismatch.
"""

import hashlib
import json
import sys


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None
        self.prev_free = None
        self.next_free = None
        self.is_null = False


class FreeQueue:
    """FreeKVCacheBlockQueue: a doubly linked list with fake head and tail."""

    def __init__(self, blocks):
        self.num_free_blocks = len(blocks)
        self.head = Block(-1)
        self.tail = Block(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft(self):
        first = self.head.next_free
        assert first is not self.tail, "no free block"
        self.remove(first)
        return first

    def remove(self, block):
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block):
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1


class Pool:
    """BlockPool: blocks, the free queue, and hash -> {block_id: block}."""

    def __init__(self, num_gpu_blocks):
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.cached = {}
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash):
        by_id = self.cached.get(block_hash)
        if not by_id:
            return None
        return next(iter(by_id.values()))

    def cache_full_blocks(self, blocks, block_hashes, num_cached, num_full):
        if num_cached >= num_full:
            return
        for i in range(num_cached, num_full):
            blk = blocks[i]
            assert blk.block_hash is None
            blk.block_hash = block_hashes[i]
            self.cached.setdefault(blk.block_hash, {})[blk.block_id] = blk

    def get_new_blocks(self, n):
        assert n <= self.free_queue.num_free_blocks
        out = []
        for _ in range(n):
            blk = self.free_queue.popleft()
            self.maybe_evict(blk)
            assert blk.ref_cnt == 0
            blk.ref_cnt += 1
            out.append(blk)
        return out

    def maybe_evict(self, blk):
        if blk.block_hash is None:
            return
        by_id = self.cached.get(blk.block_hash)
        if by_id is not None and by_id.pop(blk.block_id, None) is not None:
            if not by_id:
                del self.cached[blk.block_hash]
        blk.block_hash = None

    def touch(self, blocks):
        for blk in blocks:
            if blk.ref_cnt == 0 and not blk.is_null:
                self.free_queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered):
        ordered = list(ordered)
        for blk in ordered:
            blk.ref_cnt -= 1
        for blk in ordered:
            if blk.ref_cnt == 0 and not blk.is_null:
                self.free_queue.append(blk)


class Request:
    def __init__(self, rid, token_ids, block_size):
        self.request_id = rid
        self.all_token_ids = list(token_ids)
        self.block_size = block_size
        self.block_hashes = []
        self.num_computed_tokens = 0
        self.update_hashes()

    @property
    def num_tokens(self):
        return len(self.all_token_ids)

    def append(self, tokens):
        self.all_token_ids.extend(tokens)
        self.update_hashes()

    def update_hashes(self):
        """Chained hashes of every full block (vLLM's request block hasher)."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= self.num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else b"root"
            chunk = self.all_token_ids[i * bs:(i + 1) * bs]
            self.block_hashes.append(
                hashlib.sha256(parent + repr(chunk).encode()).digest())


class Manager:
    """KVCacheManager over one FullAttentionManager, caching on."""

    def __init__(self, capacity_blocks, block_size):
        # The null block takes one of vLLM's blocks: C usable needs C + 1.
        self.pool = Pool(capacity_blocks + 1)
        self.block_size = block_size
        self.req_to_blocks = {}
        self.num_cached_block = {}

    def find_longest_cache_hit(self, block_hashes, max_length):
        hit = []
        for h in block_hashes[:max_length // self.block_size]:
            blk = self.pool.get_cached_block(h)
            if blk is None:
                break
            hit.append(blk)
        return hit

    def get_computed_blocks(self, req):
        hit = self.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
        return hit, len(hit) * self.block_size

    def allocate_slots(self, req, num_new_tokens, num_new_computed=0, computed=()):
        computed = list(computed)
        num_computed = req.num_computed_tokens + num_new_computed
        need = num_computed + num_new_tokens
        have = self.req_to_blocks.get(req.request_id, [])
        required = -(-need // self.block_size)
        num_new = required - len(computed) - len(have)
        evictable = sum(1 for b in computed if b.ref_cnt == 0 and not b.is_null)
        if max(num_new, 0) + evictable > self.pool.free_queue.num_free_blocks:
            return None
        self.pool.touch(computed)
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        if computed:
            blocks.extend(computed)
            self.num_cached_block[req.request_id] = len(computed)
        if num_new > 0:
            blocks.extend(self.pool.get_new_blocks(num_new))
        to_cache = min(num_computed + num_new_tokens, req.num_tokens)
        num_cached = self.num_cached_block.get(req.request_id, 0)
        num_full = to_cache // self.block_size
        self.pool.cache_full_blocks(blocks, req.block_hashes, num_cached, num_full)
        self.num_cached_block[req.request_id] = max(num_cached, num_full)
        req.num_computed_tokens = to_cache
        return blocks

    def free(self, req):
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(req.request_id, None)


def main(path):
    pods = {}
    running = {}
    admits = 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            op = json.loads(line)
            pod = op["pod"]
            if "capacity_blocks" in op:
                pods[pod] = Manager(op["capacity_blocks"], op["block_size"])
                continue
            m = pods[pod]
            key = (pod, op["req"])
            if op["op"] == "admit":
                req = Request(op["req"], op["token_ids"], m.block_size)
                uncapped = len(m.find_longest_cache_hit(req.block_hashes, req.num_tokens))
                if uncapped != op["hit_blocks"]:
                    print(f"line {n}: {pod} {op['req']}: hit_blocks {op['hit_blocks']}, "
                          f"vLLM's block pool holds {uncapped}")
                    return 1
                computed, num_computed = m.get_computed_blocks(req)
                got = m.allocate_slots(req, req.num_tokens - num_computed, num_computed, computed)
                if got is None:
                    print(f"line {n}: {pod} {op['req']}: admitted, but vLLM cannot allocate it")
                    return 1
                running[key] = req
                admits += 1
            elif op["op"] == "extend":
                req = running[key]
                req.append(op["token_ids"])
                if m.allocate_slots(req, len(op["token_ids"])) is None:
                    print(f"line {n}: {pod} {op['req']}: vLLM cannot allocate the extension")
                    return 1
            elif op["op"] == "finish":
                m.free(running.pop(key))
            else:
                print(f"line {n}: unknown op {op['op']!r}")
                return 1
    print(f"{admits} admits match")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
