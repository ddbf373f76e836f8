"""The package's structure: no import cycles anywhere in kvfuzz/, and every import pointing down an ordered list of
layers (contract -> allocators -> engine model -> programs -> shrinking -> machine -> runner -> saved failures ->
commands/CLI)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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


# The layers, lowest first. A module belongs to the layer of the longest prefix listed here ("kvfuzz" names the
# package's own __init__ alone, so a new top-level module must be placed); every import between two
# modules of different prefixes points to a strictly lower layer (imports inside one package, or one module, are that
# package's own business, and the cycle test covers them).
LAYERS: tuple[tuple[str, ...], ...] = (
    # the package's version; words; torch's threads; whether torch imports; the defaults the parsers show; a child
    # process's tie to its parent; the line a dying run leaves; what every generated reproducer shares; every target's
    # swarm-table rows and pins; every trace format's file (its bytes read, its fields checked, its atomic save)
    (
        "kvfuzz",
        "kvfuzz.text",
        "kvfuzz.threads",
        "kvfuzz.torch_check",
        "kvfuzz.option_defaults",
        "kvfuzz.lifeline",
        "kvfuzz.last_words",
        "kvfuzz.reproducer_text",
        "kvfuzz.swarm_table",
        "kvfuzz.trace_files",
        "kvfuzz.exported_test",
    ),
    ("kvfuzz.trace_format",),  # the envelope every trace format shares, above the file layer
    ("kvfuzz.coverage",),  # which lines and branches of the code under test a process reaches
    ("kvfuzz.allocator",),  # the contract, and kvfuzz's own allocators
    ("kvfuzz.reference", "kvfuzz.accounting", "kvfuzz.model"),  # K/V content and attention; paging arithmetic
    ("kvfuzz.kernels",),  # attention kernels of invariant 2
    ("kvfuzz.adapters",),  # third-party allocators behind the contract
    ("kvfuzz.engine",),  # the engine kvfuzz plays, its expected state and checks
    ("kvfuzz.zoo", "kvfuzz.workload"),  # broken allocators, each with its invariant; workload replay on the engine
    ("kvfuzz.registry",),  # allocators by name
    ("kvfuzz.trace_saving",),  # where a trace went, and the replay and show commands printed for it
    ("kvfuzz.program",),  # the operation table, programs, replay
    ("kvfuzz.shrink",),  # failure signatures, and shrinking a failing program to a fixpoint
    # the Hypothesis machine, its settings profiles, and the one Hypothesis search every target runs
    ("kvfuzz.statemachines", "kvfuzz.profiles", "kvfuzz.hypothesis_search"),
    # run(): search, shrink, summarise; the real-scheduler target (its worker, checks, machine and search), which
    # needs only the reference's K/V beneath it
    ("kvfuzz.runner", "kvfuzz.scheduler"),
    ("kvfuzz.isolation",),  # isolation, every target's: a body in a child process, its result or how it ended
    ("kvfuzz.saved",),  # traces, the corpus, journals
    ("kvfuzz.reproducers",),  # standalone reproducers of allocator traces (report)
    ("kvfuzz.trace", "kvfuzz.corpus"),  # kvfuzz.saved's trace and corpus under their names before the move
    ("kvfuzz.timeline", "kvfuzz.campaign", "kvfuzz.zoo_run"),  # show; campaigns; zoo; --isolate
    ("kvfuzz.isolated_run",),  # run --isolate: the allocator's run in a child, its example database a campaign's
    ("kvfuzz.commands",),  # the subcommands
    ("kvfuzz.pytest_scheduler",),  # the plugin's search of a scheduler target
    ("kvfuzz.pytest_plugin",),  # the pytest plugin
    ("kvfuzz.cli",),  # the kvfuzz command
    ("kvfuzz.__main__",),  # python -m kvfuzz, the same command
)


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix that places it) of a module: the longest prefix in LAYERS it falls under."""
    placed = [
        (len(prefix), index, prefix)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix != "kvfuzz" and module.startswith(prefix + "."))
    ]
    assert placed, f"{module} is in no layer: add it to LAYERS in tests/test_architecture.py"
    _, index, prefix = max(placed)
    return index, prefix


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import between two prefixes that does not point to a strictly lower layer."""
    bad = []
    for module, targets in graph.items():
        here, home = layer_of(module)
        for target in targets:
            there, other = layer_of(target)
            if other != home and there >= here:
                bad.append(f"{module} (layer {here}) imports {target} (layer {there})")
    return sorted(bad)


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"kvfuzz.engine.engine": {"kvfuzz.program.operations"}, "kvfuzz.program.operations": set()}
    assert upward_imports(graph) == [
        f"kvfuzz.engine.engine (layer {layer_of('kvfuzz.engine')[0]}) imports kvfuzz.program.operations "
        f"(layer {layer_of('kvfuzz.program')[0]})"
    ]
    assert upward_imports({"kvfuzz.program.operations": {"kvfuzz.engine.engine"}, "kvfuzz.engine.engine": set()}) == []
    # Two packages of one layer do not import each other either.
    assert upward_imports({"kvfuzz.campaign.worker": {"kvfuzz.timeline.record"}, "kvfuzz.timeline.record": set()})
    # A top-level module no layer names is refused, not taken for the package's own __init__.
    with pytest.raises(AssertionError, match="kvfuzz.unplaced is in no layer"):
        layer_of("kvfuzz.unplaced")


def test_every_import_points_down_the_layers() -> None:
    """Data flows one way: contract -> allocators -> engine model -> programs -> machine -> runner -> saved failures
    -> campaigns and the timeline -> commands and the plugin -> the CLI."""
    bad = upward_imports(import_graph())
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


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


def optional_calls(source: str) -> set[str]:
    """The capability protocols a module narrows the allocator to (``cast(Forks, ...)``): the optional methods it
    calls."""
    from kvfuzz.allocator.protocol import CAPABILITY_PROTOCOLS

    protocols = {protocol.__name__ for protocol in CAPABILITY_PROTOCOLS.values()}
    return {
        node.args[0].id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "cast"
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id in protocols
    }


def test_the_optional_check_finds_an_optional_call() -> None:
    assert optional_calls("x = cast(Forks, allocator).fork(parent, child)") == {"Forks"}
    assert optional_calls("x = cast(HostTier, feature).ordered(seq, loads)") == set()


def test_an_optional_capability_s_operations_live_in_its_feature_module() -> None:
    """engine.py keeps the core operations: the optional ones (fork, preempt, swaps, rollback, evictions) are their
    feature modules' (engine/features/), and engine.py calls no optional method but the cache reset of quiesce."""
    assert optional_calls((PACKAGE / "engine" / "engine.py").read_text()) <= {"Evicts"}


def one_feature_checks(checks: dict[str, str], callers: dict[str, str]) -> list[str]:
    """The checker methods (``checks``: checks module path -> its source) that one feature module alone calls
    (``callers``: module path -> its source, the checks modules included): those belong in that feature."""
    found = []
    for module, source in checks.items():
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef):
                continue
            if "Checker" not in {base.id for base in node.bases if isinstance(base, ast.Name)}:
                continue  # the shared context, a snapshot: no checks
            for method in node.body:
                if not isinstance(method, ast.FunctionDef) or method.name.startswith("_"):
                    continue
                called = {path for path, text in callers.items() if f".{method.name}(" in text} - {module}
                if len(called) == 1 and next(iter(called)).startswith("engine/features/"):
                    found.append(f"{node.name}.{method.name} ({module}), called only by {next(iter(called))}")
    return sorted(found)


def test_the_one_feature_check_finder_finds_one() -> None:
    checks = {"engine/checks/x.py": "class X(Checker):\n    def shared(self): ...\n    def mine(self): ...\n"}
    callers = {
        "engine/features/a.py": "checks.x.shared(); checks.x.mine()",
        "engine/engine.py": "checks.x.shared()",
        **checks,
    }
    assert one_feature_checks(checks, callers) == ["X.mine (engine/checks/x.py), called only by engine/features/a.py"]


def test_a_check_one_feature_alone_triggers_lives_in_that_feature() -> None:
    """A check of engine/checks/ is one that the core, or several features, trigger; a check only one feature
    triggers is a function of that feature's module (docs/invariants.md)."""
    sources = {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}
    checks = {path: text for path, text in sources.items() if path.startswith("engine/checks/")}
    assert one_feature_checks(checks, sources) == []


# -- the pipeline: each stage in one place, for every target (docs/architecture.md, "The pipeline") ----------------

STAGES = {
    "journal": "program/safeguards.py",  # the one journal class every target writes
    "journal recovery": "saved/journals.py",  # the one reader turning a dead process's journal into a trace
    "campaign loop": "campaign/supervisor.py",  # the one loop that runs workers and ends in a CampaignResult
    "known findings": "campaign/known.py",  # the one table of what the corpus knows, and who is credited
    "shared findings": "campaign/cluster.py",  # the one place a finding is stored in Redis
    "isolation": "isolation.py",  # the one child process of its own group a target's work runs in
    "trace commands": "commands/trace_kinds.py",  # the one place replay, show, export and report tell kinds apart
    "swarm table": "swarm_table.py",  # the one kind of row a target's swarm table is made of, and its pins
    "trace file": "trace_files.py",  # the one reader of a trace file's bytes, checker of fields, atomic writer
    "exported test": "exported_test.py",  # the one frame of a trace exported as a pytest file
    "trace envelope": "trace_format.py",  # the one reader of the fields every format shares: version, bug status
    "saved trace": "trace_saving.py",  # the one record of where a trace went, and what is printed of it
    "coverage feedback": "campaign/feedback.py",  # the one per-example coverage, seed keeping and bandit
    "claims": "campaign/claims.py",  # the one judgement of a signature a worker met: known, met before, or new
    "Hypothesis search": "hypothesis_search.py",  # the one run of a state machine under Hypothesis, its end told
    "deletion": "shrink/deletion.py",  # the one delta debugging over a failing program, every target's
}


def stage_definitions(sources: dict[str, str]) -> dict[str, set[str]]:
    """Stage -> the modules (``sources``: path -> source) that define it, read from their syntax trees:

    * a **journal**: a class named ``...Journal`` that is not the journal itself subclassed (a base named
      ``Journal``) nor an exception (a base named ``...Error`` or ``...Exception``);
    * **journal recovery**: a function whose name says it reads or recovers a journal (``read_journal``,
      ``recover``, ``last_program``, ...: ``recover`` or ``read`` with ``journal``, or ``last_program``);
    * a **campaign loop**: a call constructing ``CampaignResult``, what every campaign loop ends in;
    * a table of **known findings**: a class with a ``credit`` method (who a finding met again is credited to);
    * **shared findings**: a module that calls both ``finding_record`` and a ``store`` method (a finding's record
      made and stored in Redis);
    * **isolation**: a call of ``os.setpgid`` (a child put in a process group of its own);
    * **trace commands**: a module of ``commands/`` that compares with ``"scheduler-trace"`` (tells a file's kind);
    * a **swarm table**'s machinery: a class with a ``pinnable`` member (a row whose values a pin is checked
      against), or a function that parses pins (a name with ``parse`` and ``pin``);
    * a **trace file**'s layer: a call of ``os.fsync`` (a file made durable, as a trace's atomic save does) or a
      call with an ``object_pairs_hook`` keyword (JSON read strictly, repeated fields refused);
    * an **exported test**'s frame: a string that says a file was "exported by kvfuzz" (the docstring every
      exported pytest file opens with);
    * the **trace envelope**: a read of a trace's ``known_bug``, ``fixed`` or ``kvfuzz_version`` field (a subscript
      or a ``get`` with that name), which every format has;
    * a **saved trace**'s record: a class with ``written`` and ``error`` fields (where a trace went: written, or not
      and why);
    * **coverage feedback**: a class with an ``example_ended`` method (coverage taken per example, a seed kept), or
      a call constructing ``Bandit`` (configurations scored by the coverage they find);
    * **claims**: a call of a signature store's ``claim`` method (a signature claimed) or one constructing
      ``Claimed`` or ``Seen`` (the campaign told a signature was claimed, or met again);
    * the **Hypothesis search**: a call of ``get_state_machine_test`` (a state machine made a Hypothesis test, to be
      run and its end told apart);
    * **deletion**: a chunk halved (``chunk //= 2``: delta debugging over a failing program's operations)."""
    found: dict[str, set[str]] = {stage: set() for stage in STAGES}
    for path, source in sources.items():
        tree = ast.parse(source)
        if _calls(tree, "finding_record") and _calls(tree, "store"):  # a finding's record made and stored here
            found["shared findings"].add(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Journal"):
                bases = {base.id for base in node.bases if isinstance(base, ast.Name)}
                if "Journal" not in bases and not any(base.endswith(("Error", "Exception")) for base in bases):
                    found["journal"].add(path)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name.lower()
                if "parse" in name and "pin" in name:
                    found["swarm table"].add(path)
                if name == "recover" or name == "last_program" or ("journal" in name and "read" in name):
                    found["journal recovery"].add(path)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "CampaignResult":
                found["campaign loop"].add(path)
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == "credit" for item in node.body
            ):
                found["known findings"].add(path)
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == "pinnable" for item in node.body
            ):
                found["swarm table"].add(path)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setpgid":
                found["isolation"].add(path)
            if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "fsync")
                or any(keyword.arg == "object_pairs_hook" for keyword in node.keywords)
            ):
                found["trace file"].add(path)
            if isinstance(node, ast.ClassDef) and {"written", "error"} <= {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }:
                found["saved trace"].add(path)
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == "example_ended" for item in node.body
            ):
                found["coverage feedback"].add(path)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Bandit":
                found["coverage feedback"].add(path)
            if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "claim" and _names_a_store(node.func.value))
                or (isinstance(node.func, ast.Name) and node.func.id in ("Claimed", "Seen"))
            ):
                found["claims"].add(path)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "exported by kvfuzz" in node.value:
                found["exported test"].add(path)
            if (
                isinstance(node, ast.AugAssign) and isinstance(node.op, ast.FloorDiv) and "chunk" in _named(node.target)  # type: ignore[arg-type]
            ):
                found["deletion"].add(path)
            if isinstance(node, ast.Call) and _named(node.func) == "get_state_machine_test":
                found["Hypothesis search"].add(path)
            if _reads_a_field(node, ("known_bug", "fixed", "kvfuzz_version")):
                found["trace envelope"].add(path)
            if path.startswith("commands/") and isinstance(node, ast.Compare):
                if any(isinstance(part, ast.Constant) and part.value == "scheduler-trace" for part in ast.walk(node)):
                    found["trace commands"].add(path)
    return found


def _reads_a_field(node: ast.AST, names: tuple[str, ...]) -> bool:
    """Whether ``node`` reads one of ``names`` from a JSON object: ``data["name"]`` or ``data.get("name", ...)``."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return isinstance(node.slice, ast.Constant) and node.slice.value in names
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in names
    )


def _named(node: ast.expr) -> str:
    """The name a call's function is reached by: ``name`` for ``name(...)`` and ``module.name(...)``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _names_a_store(node: ast.expr) -> bool:
    """Whether ``node`` names a signature store: ``store``, ``self.store``, ``...store`` (a worker's claims object,
    or a block pool's claim of slots, is not one)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("store")


def _calls(tree: ast.AST, name: str) -> bool:
    """Whether ``tree`` calls a function or a method named ``name``."""
    return any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
        )
        for node in ast.walk(tree)
    )


def test_the_stage_finder_finds_a_second_journal_and_a_second_loop() -> None:
    sources = {
        "program/safeguards.py": "class Journal:\n    def call(self, record): ...\n",
        "scheduler/journal.py": "class ProgramJournal:\n    pass\ndef read_journal(path): ...\n",
        "campaign/scheduler/workers.py": "class WorkerJournal(Journal): ...\nclass NotAJournal(OSError): ...\n",
        "campaign/scheduler/loop.py": "def run():\n    return CampaignResult(workers=1)\n",
        "campaign/scheduler/known.py": "class KnownFindings:\n    def credit(self, key): ...\n",
        "campaign/scheduler/shared.py": "def share(c, t):\n    r = finding_record(t)\n    c.store(t.key, r)\n",
        "campaign/scheduler/isolated.py": "def _child():\n    os.setpgid(0, 0)\n",
        "commands/show.py": "def run(path):\n    if json_file_kind(path) == 'scheduler-trace':\n        return 1\n",
        "scheduler/pins.py": "def parse_pins(texts): ...\n",
        "scheduler/trace.py": "def save(t, d):\n    os.fsync(h.fileno())\n",
        "saved/trace.py": "def parse_json(raw):\n    return json.loads(raw, object_pairs_hook=unique)\n",
        "scheduler/recorder.py": "class SavedSchedulerTrace:\n    written: bool\n    error: Optional[str]\n",
        "scheduler/swarm.py": "class Dimension:\n    @property\n    def pinnable(self): ...\n",
        "campaign/scheduler/guided.py": "class Guidance:\n    def example_ended(self): ...\n",
        "campaign/worker.py": "def plan():\n    return Bandit()\n",
        "campaign/scheduler/claims.py": "def is_new(s):\n    return store.claim(s, {}) is None\n",
        "campaign/allocator_worker.py": "def met(r, s):\n    r.send(Seen(0, s, s.key(), 'x'))\n",
        "trace_format.py": "def check(data):\n    return data.get('known_bug'), data['kvfuzz_version']\n",
        "scheduler/sglang/traces.py": "def status(d):\n    w = {'fixed': None}\n    return d['fixed']\n",
        "exported_test.py": "def frame(s):\n    return f'Regression test exported by kvfuzz from {s}'\n",
        "scheduler/export.py": "HEADER = 'A test exported by kvfuzz'\n",
        "hypothesis_search.py": "def search_machine(m, s):\n    return get_state_machine_test(m, settings=s)\n",
        "scheduler/search.py": "def search(m):\n    stateful.get_state_machine_test(m)()\n",
        "shrink/deletion.py": "def delete(p):\n    chunk = len(p)\n    chunk //= 2\n",
        "scheduler/shrink.py": "def ddmin(p):\n    self.chunk //= 2\n    size = 4\n    size //= 2\n",
    }
    found = stage_definitions(sources)
    assert found["journal"] == {"program/safeguards.py", "scheduler/journal.py"}
    assert found["journal recovery"] == {"scheduler/journal.py"}
    assert found["campaign loop"] == {"campaign/scheduler/loop.py"}
    assert found["known findings"] == {"campaign/scheduler/known.py"}
    assert found["shared findings"] == {"campaign/scheduler/shared.py"}
    assert found["isolation"] == {"campaign/scheduler/isolated.py"}
    assert found["trace commands"] == {"commands/show.py"}
    assert found["swarm table"] == {"scheduler/pins.py", "scheduler/swarm.py"}
    assert found["trace file"] == {"scheduler/trace.py", "saved/trace.py"}
    assert found["saved trace"] == {"scheduler/recorder.py"}
    assert found["coverage feedback"] == {"campaign/scheduler/guided.py", "campaign/worker.py"}
    assert found["claims"] == {"campaign/scheduler/claims.py", "campaign/allocator_worker.py"}
    assert found["trace envelope"] == {"trace_format.py", "scheduler/sglang/traces.py"}
    assert found["exported test"] == {"exported_test.py", "scheduler/export.py"}
    assert found["Hypothesis search"] == {"hypothesis_search.py", "scheduler/search.py"}
    assert found["deletion"] == {"shrink/deletion.py", "scheduler/shrink.py"}


def test_each_stage_of_the_pipeline_is_written_once_for_every_target() -> None:
    """The allocator target and the scheduler targets share one journal, one recovery of it, one campaign loop, one
    table of known findings, one store of shared findings, one isolation, one dispatch of the trace commands, one
    reader of the fields every trace format shares, one frame of an exported test, one Hypothesis search and one
    delta debugging of a failing program:
    a target that needs its own has a payload or a protocol method for it (docs/architecture.md), never a second
    module."""
    sources = {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}
    found = stage_definitions(sources)
    assert found == {stage: {module} for stage, module in STAGES.items()}, found
