"""The coverage vLLM's own unit tests reach of its scheduler and KV cache code, measured by kvfuzz's coverage
(kvfuzz.coverage: the same points and the same figures a ``--coverage`` campaign reports), so that a campaign's
figures compare with the tests' on any vLLM version.

The tests come from vLLM's source distribution on PyPI (its wheel holds no tests): ``--tests DIR`` names an
unpacked ``tests/`` folder, ``--sdist FILE`` a downloaded ``vllm-VERSION.tar.gz``; without either the script
downloads the installed vLLM's source distribution itself: it finds the file in the package index's JSON listing
(``PIP_INDEX_URL``, else PyPI's ``https://pypi.org/simple/``) and checks its SHA-256 against the listing.
(``pip download`` cannot: pip prepares an sdist's metadata, which for vLLM installs its build dependencies, a CUDA
torch among them.)

They run offline on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``), in this process, with pytest's
``--noconftest``; ``VLLM_MODEL_REDIRECT_PATH`` points
``facebook/opt-125m`` and ``facebook/opt-350m`` at folders holding only a ``config.json`` with OPT's public
hyper-parameters (vLLM's own model-name redirect). Tests that need other hub models fail offline and are counted.
Measuring starts after pytest's collection (and so after torch's import), as the tracer must.

Run it with the interpreter of a vLLM environment (``scripts/third_party_env.sh vllm VLLM_ENV``), from the
repository root::

    PYTHONPATH=. VLLM_ENV/bin/python scripts/vllm_tests_coverage.py --sdist vllm-0.33.0.tar.gz
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

CORE_TESTS = (
    "v1/core/test_scheduler.py",
    "v1/core/test_async_scheduler.py",
    "v1/core/test_priority_preemption_bug.py",
    "v1/core/test_prefix_replay.py",
    "v1/core/test_deferred_block_free.py",
    "v1/core/test_swa_inflight_window_free.py",
    "v1/core/test_worker_slot_overflow.py",
    "v1/core/test_output.py",
    "v1/core/test_prefix_caching.py",
    "v1/core/test_kv_cache_utils.py",
    "v1/core/test_single_type_kv_cache_manager.py",
    "v1/core/test_kv_sharing.py",
    "v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
    "v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "v1/kv_connector/unit/test_invalid_blocks_correctness.py",
)
"""vLLM's tests of its scheduler and KV cache (relative to ``tests/``); those missing from a version are skipped."""

OPT = {
    "facebook/opt-125m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072},
    "facebook/opt-350m": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "ffn_dim": 4096,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
    },
}
"""OPT's public hyper-parameters, per model (the rest are :data:`OPT_COMMON`)."""

OPT_COMMON = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
}


def tests_folder(args: argparse.Namespace, scratch: Path) -> Path:
    """The ``tests/`` folder to run: given, unpacked from the given sdist, or from one downloaded."""
    if args.tests:
        return Path(args.tests)
    sdist = Path(args.sdist) if args.sdist else download_sdist(importlib.metadata.version("vllm"), scratch)
    with tarfile.open(sdist) as archive:
        members = [member for member in archive.getmembers() if "/tests/" in member.name and member.isfile()]
        archive.extractall(scratch, members=members, filter="data")
    (folder,) = scratch.glob("vllm-*/tests")
    return folder


def download_sdist(version: str, scratch: Path) -> Path:
    """vLLM ``version``'s source distribution, downloaded into ``scratch`` from the package index's JSON listing
    (PEP 691) and checked against the SHA-256 the listing gives; exits with one line where there is none."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/")
    name = f"vllm-{version}.tar.gz"
    listing_url = f"{index}/vllm/"
    try:
        request = urllib.request.Request(listing_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            listing = json.load(response)
        found = [entry for entry in listing["files"] if entry["filename"] == name]
        if not found:
            raise ValueError("the listing has no such file")
        (entry,) = found
        path = scratch / name
        with urllib.request.urlopen(urllib.parse.urljoin(listing_url, entry["url"]), timeout=600) as response:
            path.write_bytes(response.read())
    except (OSError, ValueError, KeyError) as error:  # no index, no JSON listing, or no such file in it
        raise SystemExit(
            f"kvfuzz: could not download {name} from {listing_url} ({type(error).__name__}: {error}): download it "
            "and pass --sdist FILE"
        ) from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["hashes"].get("sha256", digest):
        raise SystemExit(f"kvfuzz: {name} from {listing_url} has SHA-256 {digest}, not the listing's")
    return path


def redirect(scratch: Path) -> Path:
    """The ``VLLM_MODEL_REDIRECT_PATH`` file: each OPT model's name -> a folder holding its ``config.json``."""
    mapping = {}
    for name, config in OPT.items():
        folder = scratch / "models" / name.replace("/", "--")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**OPT_COMMON, **config, "_name_or_path": name}))
        mapping[name] = str(folder)
    path = scratch / "redirect.json"
    path.write_text(json.dumps(mapping))
    return path


class Measure:
    """The pytest plugin: the measurer started once collection is done, stopped when the session ends."""

    def __init__(self, files: tuple[str, ...]) -> None:
        from kvfuzz.coverage.measure import Reached, measurer

        self.measurer = measurer(files)
        self.reached = Reached()
        self.outcomes: dict[str, int] = {}
        self.started = 0.0

    def pytest_collection_finish(self, session: Any) -> None:
        self.started = time.perf_counter()
        self.measurer.start()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.outcome] = self.outcomes.get(report.outcome, 0) + 1

    def pytest_sessionfinish(self, session: Any) -> None:
        self.measurer.stop()
        self.reached = self.measurer.take()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", metavar="DIR", help="vLLM's unpacked tests/ folder")
    parser.add_argument("--sdist", metavar="FILE", help="vLLM's source distribution (vllm-VERSION.tar.gz)")
    parser.add_argument("--json", metavar="FILE", help="write the figures (and the points reached) as JSON")
    parser.add_argument("--html", metavar="DIR", help="write an HTML report of the files' lines reached and missed")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = parser.parse_args()
    import pytest

    from kvfuzz.coverage.report import summarize, write_html
    from kvfuzz.coverage.scope import CORE_FILES, engine_scope

    with tempfile.TemporaryDirectory(prefix="kvfuzz-vllm-tests-") as scratch:
        tests = tests_folder(args, Path(scratch)).resolve()
        os.environ.update(
            VLLM_MODEL_REDIRECT_PATH=str(redirect(Path(scratch))),
            VLLM_TARGET_DEVICE="cpu",  # vLLM's CPU platform: the tests' configurations infer their device from it
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        files = [str(tests / name) for name in CORE_TESTS if (tests / name).exists()]
        scope = engine_scope("vllm-v1")
        assert scope is not None, "vLLM is not installed here"
        measured = scope.files()
        plugin = Measure(measured)
        sys.path.insert(0, str(tests.parent))  # the tests import their helpers as tests.v1.core.utils
        status = pytest.main(
            [*files, "--noconftest", "-q", "-p", "no:cacheprovider", f"--rootdir={tests.parent}", *args.pytest_args],
            plugins=[plugin],
        )
        seconds = time.perf_counter() - plugin.started
    summary = summarize(plugin.reached, scope.imported(measured))
    version = importlib.metadata.version("vllm")
    print(
        f"\nvLLM {version}'s tests ({len(files)} files): {plugin.outcomes} in {seconds:.0f} s measured "
        f"(pytest exit {status}); python {sys.version.split()[0]}, {type(plugin.measurer).__name__}"
    )
    rows = {row.name: row for row in summary.files}
    for name in CORE_FILES["vllm-v1"]:
        row = rows.get(name)
        if row is not None:
            print(
                f"  {name:<46} {row.percent:5.1f}%  ({row.lines_reached}/{row.lines} lines, "
                f"{row.branches_reached}/{row.branches} branches)"
            )
    print(f"  {summary.describe()}")
    if args.json:
        data = {"vllm": version, "outcomes": plugin.outcomes, **summary.to_json(), "points": plugin.reached.to_json()}
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.html:
        print(
            f"  HTML: {write_html(Path(args.html), plugin.reached, scope.imported(measured), f'vLLM {version} tests')}"
        )


if __name__ == "__main__":
    main()
