"""The heap housekeeping of long-running processes: on glibc, trimming returns freed pages."""

import threading

import pytest

from dit_serve.server import heap

glibc = pytest.mark.skipif(heap._libc() is None, reason="needs glibc")


@glibc
def test_trim_returns_freed_pages_to_the_system():
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    blocks = [bytearray(4000) for _ in range(50_000)]  # ~200 MB of small blocks: below the mmap threshold
    blocks[-1][0] = 1
    high = rss()
    del blocks
    heap.trim()
    assert rss() < high - 20_000  # pages (4 KiB): at least ~80 MB went back


@glibc
def test_limit_arenas_and_the_trim_loop_stop():
    assert heap.limit_arenas(2) is True
    stop = threading.Event()
    t = threading.Thread(target=heap.trim_every, args=(0.01, stop))
    t.start()
    stop.set()
    t.join(30)
    assert not t.is_alive()
