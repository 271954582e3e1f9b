"""Shared fixtures for the CPU tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for the module (CI has 2 cores shared by the whole run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
