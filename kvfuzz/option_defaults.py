"""The defaults and choices that ``kvfuzz``'s parsers and the pytest plugin's options show, spelled here without
importing torch, Hypothesis or the engine: ``--help`` and usage errors answer at once, and where torch cannot be
imported at all. Each mirrors a value defined with the code that uses it; tests/test_without_torch.py checks that
every one equals its source."""

from __future__ import annotations

BLOCK_SIZE = 4  # kvfuzz.engine.config.MachineConfig().block_size
NUM_BLOCKS = 16  # MachineConfig().num_blocks
NUM_HOST_BLOCKS = 4  # MachineConfig().num_host_blocks
NUM_LAYERS = 2  # kvfuzz.reference.content.ModelShape().num_layers
NUM_KV_HEADS = 2  # ModelShape().num_kv_heads
NUM_QUERY_HEADS = 4  # ModelShape().num_query_heads
HEAD_DIM = 8  # ModelShape().head_dim
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # tuple(kvfuzz.engine.config.DTYPES)
KERNEL_NAMES = (
    "gather",
    "flex",
    "allocator",
    "vllm-triton",
    "sglang-triton",
    "flex-compiled",
    "flashinfer",
    "flashinfer-prefill",
)  # kvfuzz.kernels.KERNEL_NAMES
CORPUS = ".kvfuzz/corpus"  # kvfuzz.commands.options.DEFAULT_CORPUS (its docstring says why hidden)
CALL_TIMEOUT = 60.0  # kvfuzz.program.safeguards.DEFAULT_CALL_TIMEOUT
CAMPAIGN_DURATION = 600.0  # kvfuzz.campaign.supervisor.DEFAULT_DURATION
PROFILE_NAMES = ("ci", "dev", "nightly")  # tuple(kvfuzz.profiles.PROFILES)
POLICY_NAMES = ("decode-first", "prefill-first")  # kvfuzz.workload.budget.POLICIES
SCHEDULER_NAMES = ("vllm-v1", "sglang")  # tuple(kvfuzz.scheduler.command.SCHEDULERS)
SCHEDULER_TOKEN_BUDGET = 16  # kvfuzz.scheduler.config.SchedulerSetup().max_num_batched_tokens
SCHEDULER_MAX_SEQS = 4  # SchedulerSetup().max_num_seqs
WRITE_PATH_NAMES = ("kvfuzz", "vllm")  # tuple(kvfuzz.scheduler.write_paths.WRITE_PATHS); the first is the default
ATTENTION_NAMES = ("off", "gather", "vllm-triton")  # tuple(kvfuzz.scheduler.attention.ATTENTIONS); first: default
SCHEDULER_POLICIES = ("fcfs", "priority")  # kvfuzz.scheduler.config.POLICIES
SCHEDULER_MODELS = (
    "full",
    "sliding-window",
    "mamba-hybrid",
    "chunked-local",
    "sliding-window-groups",
    "rswa",
)  # tuple(kvfuzz.scheduler.models.MODELS)
