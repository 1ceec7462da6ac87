import os

# CPU-only: Inductor's CPU code without its vector ISA. The CPU tests of the compiled path check what does
# not depend on it (one compile for every bucket, equality with the uncompiled step, the cache across
# processes), and its vectorised C++ took about half of each cold compile (20 of 45 s for the digits
# step on the 2-core development machine). Set in the environment so the tests' subprocesses (a second
# process on the same cache, Ray workers, the service) inherit it; GPU runs compile Triton, unaffected.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# The reference pipelines (diffusers' own classes loading a directory) load their text encoders through
# transformers, which from version 5 swaps layers for kernels fetched from a model hub unless this says no:
# the references compute with PyTorch's layers, and nothing is fetched.
os.environ.setdefault("USE_HUB_KERNELS", "0")
# One intra-op thread: every model the CPU tests run is tiny (8x8 digits, a few blocks of width 128), where a
# second OpenMP thread mostly waits at barriers, and on a loaded machine (two cores, other processes) those waits
# made runs ten to thirty times slower (the digits-text oracle in FP8: 63 s with two threads, 2.3 s with one).
# Set in the environment too, so the tests' subprocesses (the CLI, the service, benchmark scripts) start with it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # already 1 where torch read OMP_NUM_THREADS above; not where it was imported earlier


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it installed, never called
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): a worker process per core (each runs one torch thread), at most 4, since
    each also starts Ray clusters and subprocesses of its own; one where CUDA is present, since the GPU tests
    share its one card."""
    if torch.cuda.is_available():
        return 1
    return min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 4)


def pytest_collection_modifyitems(config, items):
    # Files with a slow test first, each file's tests in their own order: `make test` hands whole files to its
    # workers in this order (--dist loadfile --no-loadscope-reorder), and a file with one long test started last
    # kept one worker busy for a minute after the other had finished.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
