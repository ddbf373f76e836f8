"""Regenerate the sample outputs shown in README.md and docs/*.md by running the commands they show.

Every terminal output shown in the documentation is a marked region that this script writes; nobody pastes output
by hand, so a sample cannot silently drift from what kvfuzz prints. A region looks like this in the markdown::

    <!-- sample: kvfuzz run --allocator zoo:NoCopyOnWrite; from: ^invariant -->
    ```text
    $ kvfuzz run --allocator zoo:NoCopyOnWrite
    ...
    invariant 5 (exclusive writes) (first failing example: #15, after … s)
    ...
    ```
    <!-- /sample -->

The opening comment holds the command exactly as a user types it (it must start with ``kvfuzz``), then optional
``; from: REGEX`` (show the output from the first line matching REGEX on, after a ``...`` line) and
``; until: REGEX`` (stop before the first line after that matching REGEX, then a ``...`` line). Everything between
the two comments is replaced. A second kind of region, ``<!-- table: zoo -->`` ... ``<!-- /table -->``, is a
markdown table generated from the code: ``zoo``, the zoo's variants (``kvfuzz.zoo.VARIANTS``), ``capabilities``,
the fields of ``Capabilities`` by feature (from their metadata), or ``cli``, every subcommand and option of the
``kvfuzz`` command (from its argparse parser: docs/cli.md).

How commands run: as a user's shell runs them, each through the installed ``kvfuzz`` command (the console script
beside this Python, so a sample is what an installed kvfuzz prints, not only what the checkout's modules print: a
stale install, or a module the package leaves out, makes a sample stale), in a fresh process with the repository root
as the current directory; standard output is what is shown, standard error (progress lines and any traceback) is dropped
unless the command fails; each distinct command runs once. A command must exit 0 or 1 (1 is a finding, e.g. a zoo
allocator caught); another status is an error for that region, which is then left as it is. ``kvfuzz run`` is
given ``--corpus`` pointing at a fresh temporary directory, so a failure's trace is never written into the
repository, and that directory is shown as ``.kvfuzz/corpus`` (``DEFAULT_CORPUS``), where the command as shown
would write it.

Volatile fields: timings differ on every run, so they are replaced by ``…`` in the output before it is shown or
compared: a number followed by `` s`` (seconds), a number followed by `` steps/s``, and a markdown table cell
holding only a decimal number (``kvfuzz zoo``'s seconds to the first failure). The shown sample is therefore
exactly the normalised output, and ``--check`` compares text with text. Everything else (example numbers, step
counts, shrunk programs, trace digests) is deterministic: runs are derandomized.

Usage::

    python scripts/samples.py              rewrite every stale region in place and list what changed
                                           (exit 2 if some region could not be rendered)
    python scripts/samples.py --check      change nothing; exit 1 listing stale regions with a diff
    python scripts/samples.py FILE ...     only these markdown files (default: README.md and docs/**/*.md)

``tests/test_samples.py`` runs the same check (:func:`judge`) in the test suite.

When a sample changes, reread the prose around it: the explanation of a shrunk program, for example, is written
against the program shown.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's kvfuzz, whatever copy is installed

from kvfuzz.commands.options import DEFAULT_CORPUS  # noqa: E402 -- after the path that finds it

REGION = re.compile(r"^<!-- (sample|table): (.+?) -->\n(.*?)^<!-- /\1 -->$", re.MULTILINE | re.DOTALL)
"""An opening comment on a line of its own, the body, and the matching closing comment on a line of its own."""

ELIDED = "..."
PLACEHOLDER = "…"

_SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")
_RATE = re.compile(r"\b\d+(?:\.\d+)? steps/s\b")
_DECIMAL_CELL = re.compile(r"(?<=\| )\d+\.\d+(?= \|)")


def normalise(text: str) -> str:
    """The output with its volatile fields replaced by placeholders, and trailing blanks stripped."""
    lines = []
    for line in text.splitlines():
        line = _RATE.sub(f"{PLACEHOLDER} steps/s", line)
        line = _SECONDS.sub(f"{PLACEHOLDER} s", line)
        if line.startswith("|"):
            line = _DECIMAL_CELL.sub(PLACEHOLDER, line)
        lines.append(line.rstrip())
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


class SampleError(RuntimeError):
    """A region that cannot be rendered: a bad marker, or a command that failed."""


def installed_kvfuzz() -> Path:
    """The ``kvfuzz`` command a user's shell runs here: the console script installed beside this Python."""
    script = Path(sys.executable).parent / "kvfuzz"
    if not script.is_file():
        raise SampleError(f"no kvfuzz command beside {sys.executable}: install this checkout (pip install .)")
    return script


def run_command(command: str) -> str:
    """Run ``command`` (``kvfuzz ...``) through the installed ``kvfuzz`` command in a fresh process from the
    repository root, as a user's shell runs it (a command run inside another program, under pytest for instance,
    may draw its examples differently); its normalised standard output."""
    words = shlex.split(command)
    if not words or words[0] != "kvfuzz":
        raise SampleError(f"sample command must start with 'kvfuzz': {command!r}")
    arguments = words[1:]
    with tempfile.TemporaryDirectory(prefix="kvfuzz-samples-") as corpus:
        if arguments[:1] == ["run"] and "--corpus" not in arguments:
            arguments += ["--corpus", corpus]
        done = subprocess.run(
            [sys.executable, str(installed_kvfuzz()), *arguments], cwd=ROOT, capture_output=True, text=True
        )
        if done.returncode not in (0, 1):
            raise SampleError(f"{command!r} exited with status {done.returncode}:\n{done.stderr}")
        return normalise(done.stdout.replace(corpus, DEFAULT_CORPUS))


def zoo_table() -> str:
    """The zoo's variants: each one's bug class, the invariant that must catch it, and whether it is deep, in the
    zoo's order."""
    from kvfuzz.zoo import VARIANTS

    rows = ["| variant | bug class | caught by | deep |", "|---|---|---|---|"]
    rows += [
        f"| {variant.name} | {variant.bug_class} | {variant.expected} | {'yes' if variant.deep else ''} |"
        for variant in VARIANTS
    ]
    return "\n".join(rows) + "\n"


def capabilities_table() -> str:
    """Every field of ``Capabilities``, by feature, from the fields' metadata."""
    import attrs

    from kvfuzz.allocator.features import capability_table
    from kvfuzz.allocator.types import Capabilities

    return capability_table(attrs.fields(Capabilities))


_CORES = re.compile(r"the cores, \d+")
"""A help text naming this machine's core count (``--workers``' default): shown without the number."""


def _cell(text: str) -> str:
    """Text for one markdown table cell: on one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _option_row(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """One option of a subcommand as a table row: its flags (or its name), the value it takes, its default, its help."""
    names = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.metavar or action.dest}`"
    takes = ""
    if not action.option_strings:  # a positional: its name is in the first column
        takes = "one or more" if action.nargs == "+" else "any number" if action.nargs == "*" else ""
    elif action.nargs != 0:
        if action.choices is not None and action.metavar is None:
            takes = "{" + ",".join(str(choice) for choice in action.choices) + "}"
        else:
            takes = str(action.metavar or action.dest.upper())
        if action.nargs in ("*", "+"):
            takes = f"{takes} ..."
    default = action.default
    shown = "" if default in (None, False, [], argparse.SUPPRESS) or not action.option_strings else f"`{default}`"
    meaning = formatter._expand_help(action) if action.help else ""  # %(default)s and the like, as --help shows them
    meaning = _CORES.sub("the cores", meaning)  # this machine's core count, which the page cannot hold
    return f"| {names} | {_cell(takes)} | {_cell(shown)} | {_cell(meaning)} |"


def cli_reference() -> str:
    """Every subcommand of ``kvfuzz`` and every option it takes, by argument group, from the argparse parser itself
    (``kvfuzz.cli``): the reference of docs/cli.md, so that it cannot drift from what the command accepts."""
    from kvfuzz.cli import _parser

    parser = _parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    summaries = {choice.dest: choice.help or "" for choice in commands._choices_actions}
    lines: list[str] = []
    for name, command in commands.choices.items():
        lines += [f"## `kvfuzz {name}`", "", f"{summaries[name][:1].upper()}{summaries[name][1:]}.", ""]
        formatter = command._get_formatter()
        for group in command._action_groups:
            actions = [action for action in group._group_actions if not isinstance(action, argparse._HelpAction)]
            if not actions:
                continue
            lines += [f"**{group.title}**", "", "| option | takes | default | meaning |", "|---|---|---|---|"]
            lines += [_option_row(action, formatter) for action in actions]
            lines.append("")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {"zoo": zoo_table, "capabilities": capabilities_table, "cli": cli_reference}


def _parse(marker: str) -> tuple[str, dict[str, str]]:
    """``COMMAND; from: REGEX; until: REGEX`` -> the command and its options."""
    command, *parts = (part.strip() for part in marker.split(";"))
    options = {}
    for part in parts:
        name, colon, value = part.partition(":")
        if not colon or name.strip() not in ("from", "until"):
            raise SampleError(f"unknown sample option {part!r} in {marker!r} (options: from, until)")
        options[name.strip()] = value.strip()
    return command, options


def _excerpt(output: str, options: dict[str, str], marker: str) -> list[str]:
    lines = output.splitlines()
    shown, before, after = lines, False, False
    if "from" in options:
        pattern = re.compile(options["from"])
        start = next((i for i, line in enumerate(lines) if pattern.search(line)), None)
        if start is None:
            raise SampleError(f"{marker!r}: no output line matches from: {options['from']!r}")
        shown, before = lines[start:], start > 0
    if "until" in options:
        pattern = re.compile(options["until"])
        stop = next((i for i, line in enumerate(shown) if i and pattern.search(line)), None)
        if stop is None:
            raise SampleError(f"{marker!r}: no output line matches until: {options['until']!r}")
        shown, after = shown[:stop], True
    while shown and not shown[-1]:
        shown = shown[:-1]
    return ([ELIDED] if before else []) + shown + ([ELIDED] if after else [])


class Renderer:
    """Renders regions, running each distinct command once."""

    def __init__(self) -> None:
        self.outputs: dict[str, str] = {}  # command -> its normalised standard output
        self.errors: dict[str, SampleError] = {}  # command -> why it could not be run (raised when it is rendered)

    def prefetch(self, commands: Sequence[str]) -> None:
        """Run the commands not run yet side by side, one per CPU: each is a process of its own and derandomized,
        so its output is the same as when run alone, and the samples take the wall time of about their total CPU
        time divided by the CPUs, not of their sum."""
        pending = [command for command in dict.fromkeys(commands) if command not in self.outputs]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {command: pool.submit(run_command, command) for command in pending}
        for command, future in futures.items():
            error = future.exception()
            if error is None:
                self.outputs[command] = future.result()
            elif isinstance(error, SampleError):
                self.errors[command] = error
            else:
                raise error

    def output(self, command: str) -> str:
        if command in self.errors:
            raise self.errors[command]
        if command not in self.outputs:
            self.outputs[command] = run_command(command)
        return self.outputs[command]

    def render(self, kind: str, marker: str) -> str:
        """The body a region should hold."""
        if kind == "table":
            if marker not in TABLES:
                raise SampleError(f"no generated table named {marker!r} (known: {', '.join(TABLES)})")
            return TABLES[marker]()
        command, options = _parse(marker)
        lines = [f"$ {command}", *_excerpt(self.output(command), options, marker)]
        return "```text\n" + "\n".join(lines) + "\n```\n"


class Region:
    """One marked region of a markdown file."""

    def __init__(self, path: Path, match: re.Match) -> None:
        self.path = path
        self.kind, self.marker, self.body = match.group(1), match.group(2), match.group(3)
        self.span = match.span(3)
        self.line = match.string.count("\n", 0, match.start()) + 1

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT) if ROOT in self.path.parents else self.path
        return f"{where}:{self.line}: {self.kind} {self.marker!r}"


def markdown_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def regions(path: Path) -> list[Region]:
    return [Region(path, match) for match in REGION.finditer(path.read_text())]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One region, judged: the body it should hold (None when it cannot be rendered, then ``error`` says why)."""

    region: Region
    want: Optional[str]
    error: Optional[str] = None

    @property
    def stale(self) -> bool:
        return self.want != self.region.body

    def describe(self) -> str:
        """What is wrong with the region, for a person: the error, or a diff of the shown body against the output."""
        if self.error is not None:
            return f"cannot render {self.region}:\n{self.error}"
        diff = difflib.unified_diff(
            self.region.body.splitlines(keepends=True),
            (self.want or "").splitlines(keepends=True),
            "shown",
            "printed now",
        )
        return f"stale: {self.region}\n{''.join(diff)}"


def judge(paths: Sequence[Path], renderer: Optional[Renderer] = None) -> list[Verdict]:
    """Every region of ``paths``, rendered (each distinct command runs once, side by side with the others)."""
    renderer = renderer or Renderer()
    found = [region for path in paths for region in regions(path)]
    commands = []
    for region in found:
        if region.kind == "sample":
            try:
                commands.append(_parse(region.marker)[0])
            except SampleError:
                pass  # reported when the region is rendered
    renderer.prefetch(commands)
    verdicts = []
    for region in found:
        try:
            verdicts.append(Verdict(region, renderer.render(region.kind, region.marker)))
        except SampleError as error:
            verdicts.append(Verdict(region, None, str(error)))
    return verdicts


def rewrite(verdicts: Sequence[Verdict]) -> None:
    """Write every stale region that could be rendered into its file; leave the rest as it is."""
    for path in dict.fromkeys(verdict.region.path for verdict in verdicts):
        text = path.read_text()
        pieces, last = [], 0
        for verdict in verdicts:
            if verdict.region.path != path or verdict.want is None:
                continue
            start, end = verdict.region.span
            pieces += [text[last:start], verdict.want]
            last = end
        pieces.append(text[last:])
        new = "".join(pieces)
        if new != text:
            path.write_text(new)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list stale samples and exit 1; change nothing")
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    paths = [path.resolve() for path in args.files] or markdown_files()
    verdicts = judge(paths)
    stale = [verdict for verdict in verdicts if verdict.stale]
    failed = [verdict for verdict in stale if verdict.error is not None]
    if args.check:
        for verdict in stale:
            print(verdict.describe())
        if stale:
            print(f"{len(stale)} of {len(verdicts)} sample(s) stale; rewrite them with: python scripts/samples.py")
            return 1
        print(f"all {len(verdicts)} samples are current")
        return 0
    rewrite(verdicts)
    for verdict in stale:
        if verdict.error is None:
            print(f"rewrote {verdict.region}; reread the prose around it")
        else:
            print(f"{verdict.describe()}\n(left as it was)", file=sys.stderr)
    if not stale:
        print(f"all {len(verdicts)} samples were current")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
