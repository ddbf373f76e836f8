"""What the engine tests expect of the installed vLLM release (kvfuzz.scheduler.vllm_release): the V1 model runner's
tests run where it exists (vLLM 0.33.0); where it does not (0.34.0 removed it) each says so and checks the new
behaviour instead: asking for V1 (``VLLM_USE_V2_MODEL_RUNNER=0``) gets V2's protocol, and vLLM's write path V2's
block tables."""

from __future__ import annotations

import os
from typing import Optional

from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.vllm_release import vllm_release
from kvfuzz.scheduler.worker import Worker
from kvfuzz.scheduler.write_paths import VllmV2BlockTables, WritePathFactory

V1_RUNNER = vllm_release().has_v1_runner
"""Whether the installed vLLM has Model Runner V1 (0.33.0) or V2 alone (0.34.0)."""


def v2_alone(setup: SchedulerSetup, write_path: Optional[WritePathFactory] = None) -> None:
    """On a vLLM without Model Runner V1, with V1 asked for: the worker speaks V2's protocol all the same, and
    vLLM's write path (``write_path``, when given) keeps V2's block tables."""
    assert not V1_RUNNER and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    worker = Worker(setup) if write_path is None else Worker(setup, write_path)
    assert worker.runner_v2, "a vLLM without Model Runner V1 selected its protocol"
    if write_path is not None:
        assert isinstance(worker.write_path, VllmV2BlockTables)
