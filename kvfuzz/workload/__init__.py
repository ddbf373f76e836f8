"""Workload replay: a continuous-batching scheduler runs a request trace against any allocator, with every kvfuzz
invariant checked, and reports admissions, refusals, preemptions, latency in steps and the pool's occupancy."""

from kvfuzz.workload.format import Request, Workload, WorkloadError, load_workload
from kvfuzz.workload.report import ReplayReport
from kvfuzz.workload.scheduler import replay_workload

__all__ = ["ReplayReport", "Request", "Workload", "WorkloadError", "load_workload", "replay_workload"]
