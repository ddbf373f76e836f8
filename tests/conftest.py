"""Shared fixtures, and the --campaign option that enables long fuzz campaigns."""

from __future__ import annotations

import pytest
import torch

from kvfuzz.statemachines import MachineConfig

# factories.py holds assertion helpers (check_counts): let pytest rewrite their asserts as in the test files.
pytest.register_assert_rewrite("factories")

# kvfuzz's tensors are tiny; intra-op threads only add overhead (see kvfuzz.threads.single_threaded_torch).
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--campaign", action="store_true", help="also run the long fuzz campaigns")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--campaign"):
        return
    skip = pytest.mark.skip(reason="long campaign: run with --campaign")
    for item in items:
        if "campaign" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def config() -> MachineConfig:
    return MachineConfig()
