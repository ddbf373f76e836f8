"""The declared cost model that turns a replay's steps into modelled seconds.

A step's time is ``fixed + per_token · batched tokens + per_kv_position · K/V positions read``: a fixed launch and
weight-reading cost, a cost per token computed in the step (prefill chunks and decodes alike), and a cost per
position of K/V the step's attention reads. Nothing here is measured on any device: the default parameters are round
figures of the order of a mid-sized model on one accelerator, and every figure derived from them is printed as
modelled, not measured.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class StepLoad:
    """The work of one step: tokens computed (written to K/V) and positions of K/V read by attention."""

    step: int  # the step, counted from 0
    batched_tokens: int  # tokens whose K/V the step computes (every prefill chunk and decode token)
    kv_positions_read: int  # positions of K/V its attention reads: each computed sequence's length after the step


@attrs.frozen
class CostModel:
    """Per-step time, modelled: ``fixed_s + per_token_s · batched_tokens + per_kv_position_s · kv_positions_read``.
    Every parameter is >= 0 and the step time is > 0."""

    fixed_s: float = attrs.field(default=0.004, validator=attrs.validators.ge(0))  # seconds every step costs
    per_token_s: float = attrs.field(default=0.00004, validator=attrs.validators.ge(0))  # per batched token
    per_kv_position_s: float = attrs.field(default=0.0000002, validator=attrs.validators.ge(0))  # per K/V position

    def seconds(self, load: StepLoad) -> float:
        return self.fixed_s + self.per_token_s * load.batched_tokens + self.per_kv_position_s * load.kv_positions_read

    def describe(self) -> str:
        return (
            f"cost model (modelled, not measured): step time = {self.fixed_s * 1e3:g} ms + "
            f"{self.per_token_s * 1e6:g} us x batched tokens + {self.per_kv_position_s * 1e6:g} us x K/V positions read"
        )

    def to_json(self) -> dict:
        return {"label": "modelled, not measured", **attrs.asdict(self)}


def clock(loads: list[StepLoad], model: CostModel) -> list[float]:
    """``starts[t]``: the modelled time at which step t begins (``starts[-1]`` is the end of the last step); steps
    run back to back from time 0."""
    starts, now = [0.0], 0.0
    for load in loads:
        now += model.seconds(load)
        starts.append(now)
    return starts
