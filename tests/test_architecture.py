"""The package's structure: no import cycles anywhere in kvfuzz/, and data flowing one way (contract -> allocator ->
engine model -> programs -> machine -> runner/CLI)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvfuzz"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvfuzz modules it imports, anywhere in its body (functions and TYPE_CHECKING blocks too):
    ``from kvfuzz.a import b`` names ``kvfuzz.a.b`` when that is a module, else ``kvfuzz.a``; and the packages whose
    ``__init__`` such an import runs first (``kvfuzz.a`` for an import of ``kvfuzz.a.b`` from outside ``kvfuzz.a``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name.startswith("kvfuzz")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not source.startswith("kvfuzz"):
                    continue
                for alias in node.names:
                    candidate = f"{source}.{alias.name}"
                    edges.add(candidate if candidate in modules else source)
        # Importing kvfuzz.a.b runs kvfuzz/a/__init__.py first, unless the importer is already inside kvfuzz.a.
        parents = {
            ".".join(edge.split(".")[:depth])
            for edge in edges
            for depth in range(2, len(edge.split(".")))
            if not (name + ".").startswith(".".join(edge.split(".")[:depth]) + ".")
        }
        graph[name] = {edge for edge in edges | parents if edge in modules and edge != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the list of modules around it, or [] when there is none."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_in_kvfuzz() -> None:
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_data_flows_one_way() -> None:
    """Lower layers never import higher ones: the engine knows no programs or Hypothesis machine, programs know no
    machine, and the workload scheduler and the zoo use the engine, never the machine or the runner."""
    graph = import_graph()
    higher = {
        "kvfuzz.allocator": {"kvfuzz.engine", "kvfuzz.program", "kvfuzz.statemachines", "kvfuzz.runner"},
        "kvfuzz.engine": {"kvfuzz.program", "kvfuzz.statemachines", "kvfuzz.runner", "kvfuzz.cli", "kvfuzz.zoo"},
        "kvfuzz.program": {"kvfuzz.statemachines", "kvfuzz.runner", "kvfuzz.cli"},
        "kvfuzz.workload.scheduler": {"kvfuzz.statemachines", "kvfuzz.program", "kvfuzz.runner"},
        "kvfuzz.workload.budget": {"kvfuzz.statemachines", "kvfuzz.program", "kvfuzz.runner", "kvfuzz.cli"},
        "kvfuzz.workload.capacity": {"kvfuzz.statemachines", "kvfuzz.program", "kvfuzz.runner", "kvfuzz.cli"},
        "kvfuzz.workload.ablation": {"kvfuzz.statemachines", "kvfuzz.program", "kvfuzz.runner", "kvfuzz.cli"},
        "kvfuzz.model": {"kvfuzz.engine", "kvfuzz.program", "kvfuzz.statemachines", "kvfuzz.runner", "kvfuzz.workload"},
        "kvfuzz.zoo.variants": {"kvfuzz.statemachines", "kvfuzz.program", "kvfuzz.runner"},
    }
    for layer, forbidden in higher.items():
        for module in [name for name in graph if name == layer or name.startswith(layer + ".")]:
            bad = sorted(
                target
                for target in reachable(graph, module)
                if any(target == f or target.startswith(f + ".") for f in forbidden)
            )
            assert not bad, f"{module} imports (directly or not) {bad}"


def test_the_engine_runs_without_hypothesis() -> None:
    """The engine model, the allocator and the workload scheduler import and run with Hypothesis unavailable."""
    script = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import kvfuzz.engine, kvfuzz.allocator, kvfuzz.workload.scheduler\n"
        "from kvfuzz.allocator import paged_allocator\n"
        "from kvfuzz.engine import Engine, MachineConfig\n"
        "engine = Engine(paged_allocator(MachineConfig().pool_spec()), MachineConfig())\n"
        "engine.admit('s0', (), (1, 2, 3)); engine.step(); engine.quiesce()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
