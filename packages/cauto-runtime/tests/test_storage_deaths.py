"""StorageDeaths dates frees made on another thread, which the profiler does not report."""

import threading

import torch

from cauto.profiler.memory_session import memory_session
from cauto.runtime.storage_deaths import StorageDeaths
from cauto.runtime.verify import allocation_peak

N = 1 << 16  # floats: 256 KiB per tensor


def _step_with_a_free_on_another_thread(dropped: threading.Event, free: threading.Event):
    """y is made here and freed by another thread after z is made: y and z are live together."""
    box = [torch.ones(N)]
    holder = threading.Thread(target=lambda: (free.wait(), box.clear(), dropped.set()))
    holder.start()
    z = torch.ones(N)
    free.set()
    dropped.wait(10)
    holder.join(10)
    return z


def test_a_free_on_another_thread_is_dated_at_the_storage_death():
    dropped, free = threading.Event(), threading.Event()
    with memory_session() as prof, StorageDeaths() as deaths:
        z = _step_with_a_free_on_another_thread(dropped, free)
    assert dropped.is_set()
    del z
    lifetimes = deaths.lifetimes()
    both = 2 * N * 4
    assert allocation_peak(prof, steady_state=True, lifetimes=lifetimes) == both
    # without the deaths, the free is dated at the end of the op that made y: one tensor's bytes
    assert allocation_peak(prof, steady_state=True) == N * 4


def test_lifetimes_follow_storages_not_views():
    with StorageDeaths() as deaths:
        x = torch.ones(N)
        v = x[1:]
        w = v * 2
        address = x.untyped_storage().data_ptr()
        del x
    lives = deaths.lifetimes()[address]
    assert lives[-1][1] is None  # the view keeps the storage alive
    del v
    assert deaths.lifetimes()[address][-1][1] is not None
    del w


def test_a_wrapper_subclass_without_storage_is_skipped():
    from torch.testing._internal.two_tensor import TwoTensor

    with StorageDeaths() as deaths:
        a, b = torch.ones(N), torch.zeros(N)
        t = TwoTensor(a, b) * 2  # the wrapper's own storage is invalid; the op runs on its halves
        inner = t.a.untyped_storage().data_ptr()
    assert inner in deaths.lifetimes()
