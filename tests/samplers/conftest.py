import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Sampler tests use tiny tensors: extra threads only add start-up cost, and on a shared, loaded CPU
    they made a 50-step run a hundred times slower. Restored afterwards for the rest of the session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
