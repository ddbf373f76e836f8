"""What kvfuzz reads of vLLM that differs between the releases it is tested on, in one place: a
:class:`VllmRelease` chosen once from the installed version (:func:`vllm_release`), asked by the worker, the batch
check, the session and the write paths instead of reading those objects themselves.

* vLLM 0.33.0 has two model runners, V1 (``GPUModelRunner``) and V2 (``gpu/model_runner.py``), chosen by
  ``VllmConfig.use_v2_model_runner``; the scheduler resumes a preempted request among the cached requests
  (``CachedRequestData.resumed_req_ids``) for V1, and as a new request for V2; ``ModelRunnerOutput`` carries
  ``req_id_to_index``; the V1 runner's block table is ``vllm.v1.worker.block_table``.
* vLLM 0.34.0 removed Model Runner V1 and with it all four: the V2 protocol is the only one.

A vLLM outside :data:`TESTED` is refused before any example unless the user runs it anyway
(``--untested-engine``): then kvfuzz speaks the protocol of the newest tested release not newer than it (the oldest
tested, for an older one), says so, and its traces record the installed version."""

from __future__ import annotations

import functools
from typing import Any, Collection

import attrs

from kvfuzz.scheduler.engines import installed_version


@attrs.frozen
class VllmRelease:
    """One tested vLLM release's protocol: what kvfuzz's model runner reads and builds its own way there."""

    version: str  # the tested release
    has_v1_runner: bool  # Model Runner V1 exists (with use_v2_model_runner, resumed_req_ids, req_id_to_index)

    def runner_v2(self, config: Any) -> bool:
        """Whether the ``VllmConfig`` selects the V2 model runner's protocol (the only one without V1)."""
        return bool(config.use_v2_model_runner) if self.has_v1_runner else True

    def resumed(self, cached: Any) -> Collection[str]:
        """The cached requests of a ``SchedulerOutput`` resumed after a preemption (the V1 runner's protocol; under V2
        a resumed request comes back as a new one, and a release without V1 has no such field)."""
        return cached.resumed_req_ids if self.has_v1_runner else ()

    def runner_output(self, output_class: Any, order: list[str], sampled: list[list[int]], connector: Any) -> Any:
        """A ``ModelRunnerOutput`` of ``sampled`` tokens for the requests in ``order``, with the KV connector's
        output (None without a connector)."""
        index = {"req_id_to_index": {request: n for n, request in enumerate(order)}} if self.has_v1_runner else {}
        return output_class(req_ids=order, sampled_token_ids=sampled, kv_connector_output=connector, **index)


TESTED: dict[str, VllmRelease] = {
    "0.33.0": VllmRelease("0.33.0", has_v1_runner=True),
    "0.34.0": VllmRelease("0.34.0", has_v1_runner=False),
}
"""The protocol of each vLLM release kvfuzz's scheduler target is tested on (:data:`kvfuzz.scheduler.engines.VLLM`'s
versions: scripts/third_party/vllm.sh builds each, .ci/run runs the engine tests in each), oldest first."""


def _release_key(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(char for char in part if char.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def vllm_release() -> VllmRelease:
    """The protocol kvfuzz speaks to the installed vLLM: its own release's where it is tested, else the newest
    tested release not newer than it (the oldest tested for an older one)."""
    version = installed_version("vllm")
    if version in TESTED:
        return TESTED[version]
    older = [release for name, release in TESTED.items() if _release_key(name) <= _release_key(version)]
    return older[-1] if older else next(iter(TESTED.values()))
