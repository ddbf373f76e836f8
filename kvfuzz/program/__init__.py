"""Programs over the operation table: the table itself, how arguments are drawn, running a program against an
allocator, random programs, and replaying recorded ones (:mod:`kvfuzz.shrink` shrinks them). Only the argument
kinds import Hypothesis (they compile to its strategies); running and replaying a program never use it."""

from kvfuzz.engine.operation import Operation
from kvfuzz.program.call import Call, program_text
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.operations import BY_NAME, OPERATIONS
from kvfuzz.program.replay import NotApplicable, ReplayOutcome, replay
from kvfuzz.program.stats import RunStats

__all__ = [
    "BY_NAME",
    "OPERATIONS",
    "Call",
    "Execution",
    "NotApplicable",
    "Operation",
    "ReplayOutcome",
    "RunStats",
    "Target",
    "program_text",
    "replay",
]
