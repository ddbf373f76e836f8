"""``kvfuzz run --scheduler``'s usage errors, in kvfuzz's own environment (no vLLM): each is one line on standard
error and exit status 2, before any work. The scheduler target itself is tested in vLLM's environment
(engine_tests/test_vllm_scheduler.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from factories import kvfuzz


@pytest.mark.parametrize(
    ("scheduler", "package", "versions", "engine"),
    [("vllm-v1", "vllm", "0.33.0 and 0.34.0", "vLLM"), ("sglang", "sglang", "0.5.22 and 0.5.23", "SGLang")],
)
def test_a_scheduler_target_without_its_engine_is_one_line_and_exit_2(
    tmp_path: Path, scheduler: str, package: str, versions: str, engine: str
) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{engine} is installed here: this is the refusal for environments without it")
    done = kvfuzz("run", "--scheduler", scheduler, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"kvfuzz: --scheduler {scheduler} needs {engine} (tested: {versions}), which is not installed here; build its "
        f"environment with scripts/third_party_env.sh {package}@VERSION"
    ]
    assert not (tmp_path / ".kvfuzz").exists()


@pytest.mark.parametrize(
    "args, line",
    [
        (["--max-num-seqs", "2"], "kvfuzz: --max-num-seqs needs --scheduler"),
        (["--no-prefix-caching"], "kvfuzz: --no-prefix-caching needs --scheduler"),
        (["--write-path", "vllm"], "kvfuzz: --write-path needs --scheduler"),
        (["--attention", "gather"], "kvfuzz: --attention needs --scheduler"),
        (["--policy", "priority"], "kvfuzz: --policy needs --scheduler"),
        (["--speculative-tokens", "2"], "kvfuzz: --speculative-tokens needs --scheduler"),
        (["--async-scheduling"], "kvfuzz: --async-scheduling needs --scheduler"),
        (["--cache-salts"], "kvfuzz: --cache-salts needs --scheduler"),
        (["--stop-tokens"], "kvfuzz: --stop-tokens needs --scheduler"),
        (["--eos"], "kvfuzz: --eos needs --scheduler"),
        (["--min-tokens"], "kvfuzz: --min-tokens needs --scheduler"),
        (["--max-loras", "2"], "kvfuzz: --max-loras needs --scheduler"),
        (["--long-prefill-token-threshold", "2"], "kvfuzz: --long-prefill-token-threshold needs --scheduler"),
        (["--max-num-active-seqs", "2"], "kvfuzz: --max-num-active-seqs needs --scheduler"),
        (["--prefill-schedule-interval", "2"], "kvfuzz: --prefill-schedule-interval needs --scheduler"),
        (["--pauses"], "kvfuzz: --pauses needs --scheduler"),
        (
            ["--scheduler", "vllm-v1", "--max-loras", "0"],
            "kvfuzz: --max-loras must be at least 1, got 0 (leave it out for no LoRA)",
        ),
        (
            ["--scheduler", "vllm-v1", "--database", "examples", "--seed", "3"],
            "kvfuzz: --seed and --database cannot be combined (Hypothesis ignores the database under a seed)",
        ),
        (
            ["--scheduler", "vllm-v1", "--database", "http://localhost:1"],
            "kvfuzz: --database http://localhost:1: only redis://HOST:PORT/N URLs, or a directory",
        ),
        (
            ["--scheduler", "vllm-v1", "--kv-heads", "1"],
            "kvfuzz: --scheduler does not take --kv-heads (yet; docs/scheduler.md says what a scheduler target covers)",
        ),
    ],
)
def test_options_of_the_other_target_are_refused_in_one_line(tmp_path: Path, args: list[str], line: str) -> None:
    done = kvfuzz("run", *args, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [line])


def test_allocator_and_scheduler_are_exclusive(tmp_path: Path) -> None:
    done = kvfuzz("run", "--scheduler", "vllm-v1", "--allocator", "zoo:leaky_free", cwd=tmp_path)
    assert done.returncode == 2
    assert "argument --allocator: not allowed with argument --scheduler" in done.stderr
