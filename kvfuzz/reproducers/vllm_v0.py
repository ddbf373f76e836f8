"""Reproducers of traces of ``kvfuzz.adapters.vllm_v0`` (vLLM 0.10.2's v0 ``SelfAttnBlockSpaceManager`` driven as its
scheduler drives it): a ``Session`` that makes the adapter's calls (``can_allocate`` and ``allocate`` at admission,
``can_append_slots`` and ``append_slots`` at growth, ``fork``, ``free``, ``swap_out`` and ``swap_in``; at a step,
the scheduler's ``access_all_blocks_in_seq``, ``get_common_computed_block_ids`` and ``mark_blocks_as_computed``),
with the account of :mod:`kvfuzz.reproducers.book` for cache soundness. Most v0 bugs are vLLM's own exceptions,
which the reproducer lets propagate. Like the adapter, it pins v0's per-process hash seeds (``hash('None')`` and the
hash of ``None``) to constants, so the program takes the same path in every process."""

from __future__ import annotations

from kvfuzz.adapters.vllm_v0_constants import ENGINE_WATERMARK, NO_EXTRA_HASH, PINNED_NONE_HASH
from kvfuzz.reproducers.program import NotReproducible
from kvfuzz.saved.trace import Trace

ADAPTER = "kvfuzz.adapters.vllm_v0"
CACHING = {
    "block_space_manager": True,
    "block_space_manager_no_caching": False,
    "block_space_manager_without_fork": True,
    "block_space_manager_chunked_prefill": True,
}
"""The factories the session plays, and whether each enables prefix caching."""

OPERATIONS = frozenset({"admit", "readmit", "grow", "decode", "free", "preempt", "step", "fork", "swap_out", "swap_in"})
ENGINE = "vLLM"


def key_of(namespace: tuple[str, ...]) -> object:
    """A namespace as its parts; the session gives each distinct one a LoRA adapter, in order of first use."""
    return list(namespace)


def check(trace: Trace) -> None:
    factory = trace.allocator.split(":")[1]
    if factory not in CACHING:
        raise NotReproducible(f"factory {factory}: the reproducer's session plays only {', '.join(CACHING)}")


def constants(trace: Trace) -> str:
    config = trace.config
    return (
        f"BLOCK_SIZE = {config.block_size}\nNUM_BLOCKS = {config.num_blocks}\n"
        f"NUM_HOST_BLOCKS = {config.num_host_blocks}\nCACHING = {CACHING[trace.allocator.split(':')[1]]}  # "
        f"enable_prefix_caching\nWATERMARK = {ENGINE_WATERMARK}  # the block manager's default, as the v0 scheduler "
        f"leaves it\nPINNED_NONE_HASH = {PINNED_NONE_HASH}\nNO_EXTRA_HASH = {NO_EXTRA_HASH}\n"
    )


RUNTIME = r'''
# ---- vLLM v0's block manager driven as vLLM 0.10.2's scheduler drives it (the same in every such reproducer) -----
import itertools

from vllm.core.block import prefix_caching_block
from vllm.core.block_manager import SelfAttnBlockSpaceManager
from vllm.core.interfaces import AllocStatus
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.sequence import Sequence, SequenceGroup, SequenceStatus


def pin_block_hashes():
    """v0 starts its hash chains from hash('None') (randomized per interpreter) and hashes None (an address) for a
    block without a LoRA adapter: pinned to constants, the same program takes the same path in every process. No
    decision within one process changes, only which arbitrary values are hashed."""
    module = prefix_caching_block
    for holder in (module.PrefixCachingBlockAllocator, module.PrefixCachingBlock, module.ComputedBlocksTracker):
        holder._none_hash = PINNED_NONE_HASH
    original = module.PrefixCachingBlock.hash_block_tokens.__func__

    def pinned(cls, is_first_block, prev_block_hash, cur_block_token_ids, extra_hash=None):
        extra = NO_EXTRA_HASH if extra_hash is None else extra_hash
        return int(original(cls, is_first_block, prev_block_hash, cur_block_token_ids, extra))

    module.PrefixCachingBlock.hash_block_tokens = classmethod(pinned)


class Session:
    """One SelfAttnBlockSpaceManager over NUM_BLOCKS device and NUM_HOST_BLOCKS host blocks; each request a vLLM
    Sequence alone in its SequenceGroup, a namespace a LoRA adapter."""

    def __init__(self):
        pin_block_hashes()
        self.manager = SelfAttnBlockSpaceManager(
            block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_HOST_BLOCKS, watermark=WATERMARK,
            enable_caching=CACHING,
        )
        self.book = Book(BLOCK_SIZE, lands_on_free=True)  # a scheduled step runs in full
        self.live = {}  # running or swapped-out request id -> (Sequence, SequenceGroup)
        self.preempted = {}  # preempted request id -> (Sequence, SequenceGroup), reset for recomputation
        self.keys = {}  # request id -> its namespace parts
        self.lora_ids = {}
        self.seq_ids = itertools.count()

    def lora(self, key):
        if not key:
            return None
        lora_id = self.lora_ids.setdefault(tuple(key), len(self.lora_ids) + 1)
        return LoRARequest(lora_name=repr(tuple(key)), lora_int_id=lora_id, lora_path=f"/kvfuzz/lora/{lora_id}")

    def slots(self, seq):
        table = self.manager.get_block_table(seq)
        return [(table[position // BLOCK_SIZE], position % BLOCK_SIZE) for position in range(seq.get_len())]

    def admit(self, request_id, key, tokens):
        """The scheduler's cached-token count, can_allocate, allocate."""
        if request_id in self.preempted:
            seq, group = self.preempted[request_id]
        else:
            lora = self.lora(key)
            seq = Sequence(next(self.seq_ids), {"type": "token", "prompt_token_ids": list(tokens)}, BLOCK_SIZE,
                           lora_request=lora)
            group = SequenceGroup(request_id=request_id, seqs=[seq], arrival_time=0.0, lora_request=lora)
        cached = 0
        if CACHING:
            cached = max(0, self.manager.get_num_cached_tokens(seq) - seq.get_num_computed_tokens())
            if cached and cached >= seq.get_len():
                cached = seq.get_len() - 1  # a full hit recomputes the last token
        status = self.manager.can_allocate(group)
        if status != AllocStatus.OK:
            self.manager.remove_seq_from_computed_blocks_tracker(seq)
            print(f"(admission of {request_id} refused: can_allocate is {status.name})")
            return
        self.manager.allocate(group)
        seq.status = SequenceStatus.RUNNING
        self.preempted.pop(request_id, None)
        self.live[request_id] = (seq, group)
        self.keys[request_id] = key
        slots = self.slots(seq)
        self.book.hit(request_id, key, list(tokens), slots, cached)
        self.book.schedule(request_id, key, list(tokens), slots, cached)

    def readmit(self, request_id):
        seq, _ = self.preempted[request_id]
        self.admit(request_id, self.keys[request_id], list(seq.get_token_ids()))

    def grow(self, request_id, tokens):
        """can_append_slots, the sampled tokens appended, append_slots (its copy-on-write copies run at the step)."""
        seq, group = self.live[request_id]
        if not self.manager.can_append_slots(group, num_lookahead_slots=len(tokens)):
            print(f"(grow of {request_id} refused)")
            return
        old = seq.get_len()
        for token in tokens:
            seq.append_token_id(token, {token: Logprob(logprob=0.0)})
        self.book.copy(self.manager.append_slots(seq, num_lookahead_slots=0))
        self.book.schedule(request_id, self.keys[request_id], list(seq.get_token_ids()), self.slots(seq), old)

    def decode(self, token):
        """One iteration: every running request whose tokens a step computed appends `token`, then a step runs."""
        for request_id, (seq, _) in list(self.live.items()):
            if seq.status == SequenceStatus.RUNNING and request_id not in self.book.scheduled:
                self.grow(request_id, [token])
        self.step()

    def fork(self, child, parent):
        """Parallel sampling: the child Sequence shares every block of the parent's."""
        parent_seq, parent_group = self.live[parent]
        child_seq = parent_seq.fork(next(self.seq_ids))
        self.manager.fork(parent_seq, child_seq)
        group = SequenceGroup(request_id=child, seqs=[child_seq], arrival_time=0.0,
                              lora_request=parent_group.lora_request)
        self.preempted.pop(child, None)
        self.live[child] = (child_seq, group)
        self.keys[child] = self.keys[parent]

    def free(self, request_id):
        seq, _ = self.live.pop(request_id)
        seq.status = SequenceStatus.FINISHED_ABORTED
        self.manager.free(seq)
        self.book.freed(request_id)

    def preempt(self, request_id):
        """Preemption by recomputation: free the blocks, reset the sequence."""
        seq, group = self.live.pop(request_id)
        seq.status = SequenceStatus.WAITING
        self.manager.free(seq)
        seq.reset_state_for_recompute()
        self.preempted[request_id] = (seq, group)
        self.book.withdraw(request_id, f"the preemption of {request_id}")

    def swap_out(self, request_id):
        seq, group = self.live[request_id]
        if not self.manager.can_swap_out(group):
            print(f"(swap-out of {request_id} refused)")
            return
        self.book.move(self.manager.swap_out(group))
        seq.status = SequenceStatus.SWAPPED

    def swap_in(self, request_id):
        seq, group = self.live[request_id]
        status = self.manager.can_swap_in(group, num_lookahead_slots=0)
        if status != AllocStatus.OK:
            print(f"(swap-in of {request_id} refused: can_swap_in is {status.name})")
            return
        self.book.move(self.manager.swap_in(group))
        seq.status = SequenceStatus.RUNNING

    def step(self):
        """The scheduler's bookkeeping around one step of the running requests: block tables read, blocks touched,
        common computed blocks asked for, then the step's blocks marked computed and its tokens counted."""
        batch = [(seq, group) for seq, group in self.live.values() if seq.status == SequenceStatus.RUNNING]
        for seq, _ in batch:
            self.manager.get_block_table(seq)
            self.manager.access_all_blocks_in_seq(seq, float(self.book.step))
            if CACHING:
                self.manager.get_common_computed_block_ids([seq])
        for seq, group in batch:
            self.manager.mark_blocks_as_computed(group, seq.data.get_num_uncomputed_tokens())
        for seq, group in batch:
            group.update_num_computed_tokens(seq.data.get_num_uncomputed_tokens())
        self.book.completed()
'''
