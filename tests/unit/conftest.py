"""Unit tests of the pure-torch algorithm: CPU, seconds, no vLLM."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny tensors: threads only add overhead (and the CI machine has 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
