"""How an exception the engine raised itself (a crash, not a check's violation) is told: its type and message, and,
for one without a message (a bare ``assert`` in vLLM), where it was raised and the statement there, so that the
report says which of the engine's own assertions failed."""

from __future__ import annotations

import linecache
import re
import traceback


def crash_message(error: BaseException) -> str:
    """``Type: message``; without a message, ``Type at path:line in function(): statement``, the path from the
    package directory on (``vllm/v1/core/sched/scheduler.py``) and the statement on one line."""
    name = type(error).__name__
    text = str(error)
    frames = traceback.extract_tb(error.__traceback__)
    if text or not frames:
        return f"{name}: {text}"
    frame = frames[-1]
    last = getattr(frame, "end_lineno", None) or frame.lineno or 0  # end_lineno: Python 3.11 on
    lines = [linecache.getline(frame.filename, number).strip() for number in range(frame.lineno or 0, last + 1)]
    statement = re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", " ".join(line for line in lines if line)))
    path = frame.filename.replace("\\", "/").split("site-packages/")[-1]
    return f"{name} at {path}:{frame.lineno} in {frame.name}(): {statement or '(source not available)'}"
