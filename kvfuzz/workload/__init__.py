"""Workload replay: a continuous-batching scheduler runs a request trace against any allocator, with every kvfuzz
invariant checked, and reports admissions, refusals, preemptions, latency in steps and the pool's occupancy. The
package itself imports only the workload format: reading and checking a workload needs no torch (the scheduler is
``kvfuzz.workload.scheduler``)."""

from kvfuzz.workload.format import Request, Workload, WorkloadError, load_workload

__all__ = ["Request", "Workload", "WorkloadError", "load_workload"]
