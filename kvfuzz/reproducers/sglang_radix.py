"""Reproducers of traces of ``kvfuzz.adapters.sglang`` (SGLang's ``RadixCache`` over a ``PagedTokenToKVPoolAllocator``
and a ``ReqToTokenPool``, driven as SGLang's scheduler drives them): a ``Session`` that makes the adapter's calls
(admission: ``init_next_round_input``, ``lock``, ``alloc_req_slots``, ``alloc_paged_token_slots_extend``; after a
step, ``checkpoint_kv_cache`` of each request that ran an extend; a free, ``release_kv_cache``; a retraction,
``release_kv_cache``, ``evict_from_tree_cache`` and ``reset_for_retract``), with the account of
:mod:`kvfuzz.reproducers.book` read off each request's ``req_to_token`` row (cache soundness at a hit, content after
each step, where the checkpoint may have repointed a row at the tree's pages)."""

from __future__ import annotations

from kvfuzz.reproducers.program import NotReproducible
from kvfuzz.saved.trace import Trace

ADAPTER = "kvfuzz.adapters.sglang"
KEY_FIELDS = {"radix_cache": ("extra_key", "cache_salt"), "radix_cache_lora": ("extra_key", "lora_id")}
"""The factories the session plays, and the ``Req`` fields a namespace's parts become."""

OPERATIONS = frozenset({"admit", "readmit", "grow", "decode", "free", "preempt", "step"})
ENGINE = "SGLang"


def key_of(namespace: tuple[str, ...]) -> object:
    """A namespace as its parts; the session passes them as the factory's ``Req`` fields."""
    return list(namespace)


def check(trace: Trace) -> None:
    factory = trace.allocator.split(":")[1]
    if factory not in KEY_FIELDS:
        raise NotReproducible(f"factory {factory}: the reproducer's session plays only {', '.join(KEY_FIELDS)}")


def constants(trace: Trace) -> str:
    fields = KEY_FIELDS[trace.allocator.split(":")[1]]
    return (
        f"PAGE_SIZE = {trace.config.block_size}\nNUM_PAGES = {trace.config.num_blocks}  # SGLang's page 0 is its "
        f"padding page, besides these\nKEY_FIELDS = {fields!r}  # the Req fields a namespace's parts become\n"
    )


SGLANG_IMPORT = r'''
import enum
import importlib
import sys
import types
from array import array

import torch


def stand_in_torchvision():
    """SGLang's memory pool imports model configs that read torchvision.transforms.InterpolationMode; where the
    torchvision wheel does not load beside torch's CPU build, a stand-in holding only that enum."""
    try:
        importlib.import_module("torchvision")
        return
    except Exception:
        pass
    importlib.import_module("transformers")
    mode = enum.Enum("InterpolationMode", {"NEAREST": "nearest", "BILINEAR": "bilinear", "BICUBIC": "bicubic",
                                           "LANCZOS": "lanczos"})
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    modules = [types.ModuleType(name) for name in names]
    for module in modules:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        module.InterpolationMode = mode
    modules[0].transforms, modules[1].functional = modules[1], modules[2]
    sys.modules.update(zip(names, modules))


stand_in_torchvision()
'''
"""What every SGLang reproducer runs before importing SGLang (its radix cache's and its scheduler's): a torchvision
stand-in where the wheel does not load beside torch's CPU build, as kvfuzz's SGLang adapter installs one."""

RUNTIME = (
    "\n# ---- SGLang's RadixCache driven as SGLang's scheduler drives it (the same in every such reproducer) "
    + "-" * 15
    + SGLANG_IMPORT
    + r'''from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend, alloc_req_slots
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, evict_from_tree_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import create_context, use_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

CONTEXT = create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")


class Session:
    """A RadixCache over NUM_PAGES pages (page_size = PAGE_SIZE) and a ReqToTokenPool; each request an SGLang Req
    whose namespace parts are KEY_FIELDS; the synchronous scheduler's calls (no overlap)."""

    def __init__(self):
        with use_context(CONTEXT):
            self.pool = PagedTokenToKVPoolAllocator(
                NUM_PAGES * PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.float16, device="cpu", kvcache=None,
                need_sort=False,
            )
            self.rows = ReqToTokenPool(
                size=NUM_PAGES, max_context_len=(NUM_PAGES + 1) * PAGE_SIZE, device="cpu", enable_memory_saver=False
            )
            self.tree = RadixCache(CacheInitParams(
                disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.pool, page_size=PAGE_SIZE
            ))
        self.book = Book(PAGE_SIZE, lands_on_free=False, unit="page")
        self.reqs = {}  # request id -> Req (running or retracted)
        self.keys = {}  # request id -> its namespace parts
        self.length = {}  # running request id -> tokens allocated in its row
        self.extended = set()  # running requests that ran an extend since the last step (checkpointed after it)
        self.retracted = set()

    def slots(self, req, count):
        """(SGLang page, offset) of the request's positions 0..count-1, off its req_to_token row."""
        row = self.rows.req_to_token[req.kv.req_pool_idx, :count].tolist()
        return [(slot // PAGE_SIZE, slot % PAGE_SIZE) for slot in row]

    def admit(self, request_id, key, tokens):
        """Match the prompt in the tree, lock the match, take a row, allocate the rest (evicting under pressure)."""
        with use_context(CONTEXT):
            req = self.reqs.get(request_id) or Req(
                request_id, "", array("q", tokens), SamplingParams(max_new_tokens=1 << 30), **dict(zip(KEY_FIELDS, key))
            )
            self.keys[request_id] = key
            req.init_next_round_input(self.tree)
            lock = self.tree.lock(req.last_node)
            needed = -(-len(tokens) // PAGE_SIZE) - req.prefix_len // PAGE_SIZE
            room = self.pool.available_size() // PAGE_SIZE + self.tree.evictable_size() // PAGE_SIZE
            if needed > room:
                self.tree.unlock(lock)
                req.prefix_len, req.last_node, req.kv.cache_protected_len = 0, None, 0
                print(f"(admission of {request_id} refused: {needed} pages needed, {room} free or evictable)")
                return
            prefix_len = req.prefix_len
            req.lock, req.extend_end = lock, len(tokens)
            alloc_req_slots(self.rows, [req], self.tree)
            row = self.rows.req_to_token[req.kv.req_pool_idx]
            row[:prefix_len] = self.tree.prefix_device_indices(req).to(torch.int32)
            self.extend(req, prefix_len, len(tokens))
        self.reqs[request_id] = req
        self.retracted.discard(request_id)
        self.length[request_id] = len(tokens)
        self.extended.add(request_id)
        slots = self.slots(req, len(tokens))
        self.book.hit(request_id, key, list(tokens), slots, prefix_len)
        self.book.schedule(request_id, key, list(tokens), slots, prefix_len)

    def extend(self, req, prefix_len, seq_len):
        """alloc_for_extend for one request whose row holds prefix_len slots."""
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        last_loc = row[prefix_len - 1 : prefix_len].to(torch.int64) if prefix_len else torch.tensor([-1])
        prefix_lens, seq_lens = torch.tensor([prefix_len]), torch.tensor([seq_len])
        out = alloc_paged_token_slots_extend(
            tree_cache=self.tree, prefix_lens=prefix_lens, prefix_lens_cpu=prefix_lens, seq_lens=seq_lens,
            seq_lens_cpu=seq_lens, last_loc=last_loc, extend_num_tokens=seq_len - prefix_len,
        )
        row[prefix_len:seq_len] = out.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = seq_len

    def readmit(self, request_id):
        """A retracted request comes back with every token it had."""
        req = self.reqs[request_id]
        self.admit(request_id, self.keys[request_id], list(req.origin_input_ids) + list(req.output_ids))

    def grow(self, request_id, tokens):
        """More tokens, allocated like a chunked-prefill continuation."""
        req, old = self.reqs[request_id], self.length[request_id]
        with use_context(CONTEXT):
            req.output_ids.extend(tokens)
            req.refresh_fill_ids()
            self.extend(req, old, old + len(tokens))
        self.length[request_id] = old + len(tokens)
        self.extended.add(request_id)
        all_tokens = list(req.origin_input_ids) + list(req.output_ids)
        self.book.schedule(request_id, self.keys[request_id], all_tokens, self.slots(req, len(all_tokens)), old)

    def decode(self, token):
        for request_id in [r for r in self.length if r not in self.book.scheduled]:
            self.grow(request_id, [token])
        self.step()

    def free(self, request_id):
        """A finished request is inserted into the tree; one with tokens no step computed is aborted."""
        req = self.reqs.pop(request_id)
        with use_context(CONTEXT):
            if request_id in self.book.scheduled:
                req.finished_reason = FINISH_ABORT()
                release_kv_cache(req, self.tree, checkpoint=False)
            else:
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
                release_kv_cache(req, self.tree, checkpoint=True)
        self.length.pop(request_id)
        self.extended.discard(request_id)
        self.book.freed(request_id)

    def preempt(self, request_id):
        """Retraction (release_req): release without inserting, evict for the requests still running, reset."""
        req = self.reqs[request_id]
        with use_context(CONTEXT):
            release_kv_cache(req, self.tree, checkpoint=False)
            evict_from_tree_cache(self.tree, (len(self.length) - 1) * envs.SGLANG_RETRACT_DECODE_STEPS.get())
            req.reset_for_retract()
        self.length.pop(request_id)
        self.extended.discard(request_id)
        self.retracted.add(request_id)
        self.book.withdraw(request_id, f"the retraction of {request_id}")

    def step(self):
        """process_batch_result: every running request is computed; those that ran an extend are checkpointed into
        the tree (which may repoint their rows at pages the tree already holds)."""
        self.book.completed()
        with use_context(CONTEXT):
            for request_id in sorted(self.extended):
                req = self.reqs[request_id]
                req.extend_end = self.length[request_id]
                checkpoint_kv_cache(req, self.tree)
        self.extended = set()
        self.book.check_contents({
            request_id: (self.keys[request_id], list(self.reqs[request_id].origin_input_ids)
                         + list(self.reqs[request_id].output_ids), self.slots(self.reqs[request_id], length))
            for request_id, length in self.length.items()
        })
'''
)
