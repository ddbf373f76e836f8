"""SGLang's own admission rules for a new request, run from its installed source: ``Scheduler.init_req_max_new_tokens``
(``max_new_tokens`` clipped to ``max_req_len`` and, through the allocator's ``max_new_tokens_for_memory``, to what
the empty pool holds) and ``validate_input_length`` (a prompt of ``max_req_input_len`` tokens or more refused).
Neither module imports in kvfuzz's SGLang environment (``sglang.srt.managers.scheduler`` and ``.utils`` need
``setproctitle``, ``einops``, ``uvicorn`` and FastAPI's router), so each function's definition is read from the
installed file and compiled alone, and called on stand-ins holding exactly what it reads: the clip runs SGLang's
code, not kvfuzz's reading of it."""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import types
from typing import Any, Callable, Optional

import attrs


def _function(module: str, qualified: str) -> Callable[..., Any]:
    """The function ``qualified`` (``name`` or ``Class.name``) of SGLang's ``module``, compiled from its source file
    without importing the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"{module} is not installed")
    with open(spec.origin, encoding="utf-8") as stream:
        tree = ast.parse(stream.read(), spec.origin)
    *owner, name = qualified.split(".")
    body = tree.body
    for part in owner:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == part)
    definition = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)
    definition.decorator_list = []
    code = compile(ast.Module(body=[definition], type_ignores=[]), spec.origin, "exec")
    namespace: dict[str, Any] = {"logger": logging.getLogger(module), "Optional": Optional, "Req": Any}
    exec(code, namespace)  # noqa: S102 -- SGLang's own installed source, one definition
    return namespace[name]  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=None)
def sglang_rules() -> types.SimpleNamespace:
    """SGLang 0.5.23's ``init_req_max_new_tokens`` and ``validate_input_length``, compiled once."""
    from sglang.srt.environ import envs

    return types.SimpleNamespace(
        init_req_max_new_tokens=_function("sglang.srt.managers.scheduler", "Scheduler.init_req_max_new_tokens"),
        validate_input_length=_function("sglang.srt.managers.utils", "validate_input_length"),
        max_new_tokens_limit=envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get(),
    )


@attrs.define
class RequestView:
    """What the two rules read and write of a ``Req``: its prompt, its sampling parameters (the real ones, whose
    ``max_new_tokens`` the clip sets) and the abort they may set, recorded here instead of finishing the ``Req``."""

    rid: str
    origin_input_ids: Any
    sampling_params: Any
    refusal: Optional[str] = None

    def set_finish_with_abort(self, error_msg: str, *args: Any, **kwargs: Any) -> None:
        self.refusal = error_msg


@attrs.frozen
class SchedulerLimits:
    """The ``Scheduler`` attributes ``init_req_max_new_tokens`` reads (one shard: ``kv_shard_widening`` 1, no
    sliding window)."""

    max_new_tokens_limit: Optional[int]
    max_req_len: int
    max_total_num_tokens: int
    page_size: int
    token_to_kv_pool_allocator: Any
    chunked_prefill_size: int
    kv_shard_widening: int = 1
    sliding_window_size: Optional[int] = None


def admit(req: Any, limits: SchedulerLimits, max_req_input_len: int) -> Optional[str]:
    """``handle_generate_request``'s two rules on ``req`` (``init_req_max_new_tokens``, then
    ``validate_input_length`` without auto-truncation), SGLang's own code: ``req.sampling_params.max_new_tokens``
    is clipped; returns the message SGLang aborts the request with, or None when it is queued."""
    rules = sglang_rules()
    view = RequestView(req.rid, req.origin_input_ids, req.sampling_params)
    rules.init_req_max_new_tokens(limits, view)
    if view.refusal is None:
        view.refusal = rules.validate_input_length(view, max_req_input_len, False)
    return view.refusal
