"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; on a busy 2-core machine, more threads only contend.

    Use it in a test file with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
