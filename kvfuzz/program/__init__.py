"""Programs over the operation table: the table itself, how arguments are drawn, running a program against an
allocator, random programs, and replaying and shrinking recorded ones. Only the argument kinds import Hypothesis
(they compile to its strategies); running, replaying and shrinking a program never use it."""

from kvfuzz.program.call import Call, program_text
from kvfuzz.program.execution import Execution, Target
from kvfuzz.program.operations import BY_NAME, OPERATIONS, Operation
from kvfuzz.program.replay import NotApplicable, ReplayOutcome, minimize, replay
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
    "minimize",
    "program_text",
    "replay",
]
