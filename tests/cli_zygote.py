"""A warm parent for the command-line tests: it imports torch and kvfuzz once, then forks one child per command.

Each test that runs ``kvfuzz`` as a child process (``factories.kvfuzz``) would otherwise pay a fresh interpreter's
start and torch's import, about two CPU-seconds, before the command does anything. This process pays it once per
test session. It reads one request per line on standard input (JSON: the arguments, the directory, the environment, the
files that take the child's standard output and error) and, for each, forks a child that becomes ``python -W ignore -m
kvfuzz.cli ARGS`` in that directory as far as the command can tell: ``sys.argv``, ``sys.path[0]`` and the working
directory are the fresh interpreter's, ``__main__`` is ``kvfuzz.cli`` run anew by ``runpy``, standard input is
``/dev/null``, and the exit status is what the interpreter would give (``SystemExit``'s code, 1 after an uncaught
exception with its traceback on standard error, the signal that killed it). It answers with two lines: the child's
pid at once (so that a caller's timeout can kill it), and its wait status once it ended.

What a fork cannot give is a fresh import: environment variables read at import time, and anything a command does
to modules at import, are the parent's. ``factories.kvfuzz`` therefore comes here only when the test's environment
is the one this process started with and no keyword argument asks for more than a captured run; otherwise it starts a
fresh interpreter as before.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

import hypothesis  # noqa: F401  (imported once here, not in every child)
import torch  # noqa: F401

import kvfuzz.cli


def _run_child(request: dict) -> None:
    """In the forked child: become ``python -W ignore -m kvfuzz.cli ARGS`` in ``request['cwd']``; never return."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.environ.clear()
        os.environ.update(request["environ"])
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()
        sys.argv = [kvfuzz.cli.__file__, *request["args"]]
        try:
            runpy.run_module("kvfuzz.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main() -> None:
    answers = os.dup(1)
    requests = sys.stdin.buffer
    while line := requests.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(answers)
            _run_child(request)
        os.write(answers, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, f"{status}\n".encode())


if __name__ == "__main__":
    main()
