"""Seeded bugs in vLLM 0.33.0's stop check (``check_stop``, per sampled token in the scheduler's
``update_from_output``): the check run as if one field of the request's sampling params held another value."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched import scheduler as scheduler_module


def check_stop_seeing(monkeypatch: pytest.MonkeyPatch, field: str, value: Any) -> None:
    """The scheduler's stop check sees ``request.sampling_params.<field>`` as ``value`` (the field is restored
    after each call, so nothing else sees the change)."""
    original = scheduler_module.check_stop

    def seeded(request: Any, max_model_len: int) -> bool:
        params = request.sampling_params
        kept = getattr(params, field)
        setattr(params, field, value)
        try:
            return bool(original(request, max_model_len))
        finally:
            setattr(params, field, kept)

    monkeypatch.setattr(scheduler_module, "check_stop", seeded)
