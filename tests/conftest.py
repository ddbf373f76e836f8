"""Shared fixtures, and the --slow option that enables the tests marked slow.

``pytest`` runs the quick selection (minutes on two cores); the tests marked ``slow`` (long fuzz campaigns, tests
that run the command line in many child processes, the browser) are skipped, with a reason that says how to run
them: ``pytest --slow`` runs everything, ``pytest --slow -m slow`` only them (the second step of ``.ci/run``).
"""

from __future__ import annotations

import pytest
import torch

from kvfuzz.statemachines import MachineConfig

# factories.py holds assertion helpers (check_counts): let pytest rewrite their asserts as in the test files.
pytest.register_assert_rewrite("factories")

# kvfuzz's tensors are tiny; intra-op threads only add overhead (see kvfuzz.threads.single_threaded_torch).
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (long campaigns, command-line child processes, the browser)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: pytest --slow runs everything, pytest --slow -m slow only the slow tests")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture
def config() -> MachineConfig:
    return MachineConfig()
