"""The caching MemoryPool: rounding, alignment, split/merge, stream-ordered reuse, stats, limit, OOM retry."""

from __future__ import annotations

import mmap
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threads import ran_without_hanging

import twophase
from twophase.runtime.memory import ALIGNMENT, MemoryPool, round_size

MiB = 1 << 20


@pytest.fixture
def pool(dev):
    """A private pool on the CPU device's memory hooks, so stats and addresses are this test's alone."""
    p = MemoryPool(dev._reserve, dev._release, dev._segment_view, name="test pool")
    yield p
    p.empty_cache()


def test_malloc_zero_gives_a_valid_minimal_block(dev):
    b = dev.malloc(0)
    try:
        assert b.size == ALIGNMENT and b.requested == 0 and b.address % ALIGNMENT == 0
        assert len(b.data) == ALIGNMENT
        b.data[:] = 7  # usable memory
    finally:
        b.free()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 3 * MiB))
def test_sizes_round_up_to_512_and_addresses_are_aligned(dev, n):
    b = dev.malloc(n)
    try:
        assert b.size == round_size(n) and b.size % 512 == 0 and n <= b.size < max(n, 1) + 512
        assert b.address % 512 == 0
        assert len(b.data) == b.size
    finally:
        b.free()


def test_malloc_rejects_bad_size_and_policy(pool):
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(twophase.ParamError, match="nbytes"):
            pool.malloc(bad)
    with pytest.raises(twophase.ParamError, match="policy"):
        pool.malloc(8, policy="gigantic")


def test_small_blocks_split_one_segment_and_merge_back(pool):
    a, b, c = pool.malloc(1000), pool.malloc(512), pool.malloc(5000)
    assert pool.stats()["segments"] == 1
    assert b.address == a.address + a.size and c.address == b.address + b.size
    a.data[:] = 1
    b.data[:] = 2
    assert (a.data == 1).all()  # neighbours do not overlap
    for blk in (b, a, c):
        blk.free()
    s = pool.stats()
    assert s["free_blocks"] == 1 and s["allocated_bytes"] == 0
    whole = pool.malloc(2 * MiB)  # the merged segment serves a request of its full size
    assert whole.address == a.address and pool.stats()["segments_reserved_total"] == 1
    whole.free()


def test_freed_block_is_reused_best_fit(pool):
    a = pool.malloc(4096)
    keep = pool.malloc(512)
    addr = a.address
    a.free()
    b = pool.malloc(3000)
    assert b.address == addr and pool.stats()["cache_hits"] >= 1
    b.free()
    keep.free()


def test_double_free_and_foreign_free_raise_invalid_state(pool, dev):
    b = pool.malloc(8)
    b.free()
    with pytest.raises(twophase.InvalidStateError, match="double free"):
        b.free()
    other = MemoryPool(dev._reserve, dev._release, dev._segment_view)
    c = other.malloc(8)
    with pytest.raises(twophase.InvalidStateError):
        pool.free(c)
    c.free()
    other.empty_cache()


def test_a_stale_handle_cannot_free_the_memory_handed_out_again(pool):
    a = pool.malloc(4096)
    a.free()
    b = pool.malloc(4096)
    assert b.address == a.address and b is not a  # the same memory under a new handle
    with pytest.raises(twophase.InvalidStateError, match="double free"):
        a.free()
    assert b.allocated and pool.stats()["allocated_bytes"] == b.size
    c = pool.malloc(4096)
    assert c.address != b.address  # the refused free returned nothing to the pool
    b.free()
    c.free()


def test_stats_track_bytes_counts_and_peaks(pool):
    a = pool.malloc(1000)
    b = pool.malloc(3 * MiB)
    s = pool.stats()
    assert s["allocated_bytes"] == 1024 + 3 * MiB and s["requested_bytes"] == 1000 + 3 * MiB
    assert s["reserved_bytes"] == 2 * MiB + 4 * MiB and s["segments"] == 2
    assert s["cached_bytes"] == s["reserved_bytes"] - s["allocated_bytes"]
    b.free()
    s = pool.stats()
    assert s["allocated_bytes"] == 1024 and s["peak_allocated_bytes"] == 1024 + 3 * MiB
    assert s["alloc_count"] == 2 and s["free_count"] == 1
    pool.reset_peak()
    assert pool.stats()["peak_allocated_bytes"] == 1024
    a.free()


def test_empty_cache_releases_wholly_free_segments_only(pool):
    used = pool.malloc(100)
    big = pool.malloc(3 * MiB)
    big.free()
    assert pool.empty_cache() == 4 * MiB
    s = pool.stats()
    assert s["reserved_bytes"] == 2 * MiB and s["segments"] == 1
    used.data[:] = 3  # the segment still in use is intact
    assert pool.empty_cache() == 0
    used.free()
    assert pool.empty_cache() == 2 * MiB and pool.stats()["reserved_bytes"] == 0


def test_limit_raises_out_of_memory_naming_requested_reserved_and_limit(pool):
    pool.set_limit(4 * MiB)
    assert pool.get_limit() == 4 * MiB
    keep = pool.malloc(3 * MiB)
    with pytest.raises(twophase.OutOfMemoryError) as info:
        pool.malloc(1536 * 1024)
    msg = str(info.value)
    assert info.value.status is twophase.Status.ERR_RUNTIME_OUT_OF_MEMORY
    assert "malloc" in msg and str(1536 * 1024) in msg
    assert re.search(r"reserved 4194304\b", msg) and re.search(r"limit 4194304\b", msg)
    assert pool.stats()["reserved_bytes"] == 4 * MiB  # the failed call reserved nothing
    keep.free()
    pool.set_limit(None)
    for bad in (-1, 1.5, True, "3"):  # 1.5 would cap at 1 byte; True is an int to Python
        with pytest.raises(twophase.ParamError, match="int >= 0"):
            pool.set_limit(bad)
    assert pool.get_limit() is None


@pytest.mark.parametrize("nbytes", [1 << 62, 1 << 70])  # mmap refuses the first, cannot even take the second
def test_a_request_past_the_address_space_is_out_of_memory(pool, nbytes):
    before = pool.stats()
    with pytest.raises(twophase.OutOfMemoryError, match=str(nbytes)):
        pool.malloc(nbytes)
    assert pool.stats()["reserved_bytes"] == before["reserved_bytes"]


def test_out_of_memory_empties_cache_and_retries_once(pool):
    pool.set_limit(4 * MiB)
    a = pool.malloc(1536 * 1024)
    a.free()  # one 2 MiB segment cached, free
    b = pool.malloc(3 * MiB)  # needs a new 4 MiB segment: fits the limit only after releasing the cached one
    s = pool.stats()
    assert s["oom_retries"] == 1 and s["reserved_bytes"] == 4 * MiB and s["segments"] == 1
    b.free()


def test_segments_released_by_a_trim_or_the_out_of_memory_retry_tell_the_release_listeners(pool, monkeypatch):
    """The ops' launch memos keep views of segments: the pool tells them when it releases one, or the memory
    stays mapped past the limit. It did so in empty_cache only, not when malloc itself released segments."""
    from twophase.runtime import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "RELEASE_LISTENERS", [lambda: calls.append(pool.stats()["reserved_bytes"])])
    pool.set_limit(4 * MiB)
    pool.malloc(1536 * 1024).free()
    b = pool.malloc(3 * MiB)  # the out-of-memory retry releases the cached 2 MiB segment
    assert pool.stats()["oom_retries"] == 1 and len(calls) == 1
    b.free()
    with pytest.raises(twophase.OutOfMemoryError):
        pool.malloc(5 * MiB)  # the retry releases the 4 MiB segment, then still fails: the listeners ran
    assert len(calls) == 2 and pool.stats()["reserved_bytes"] == 0
    assert pool.empty_cache() == 0 and len(calls) == 2  # nothing released: nobody told


def test_a_freed_block_handle_does_not_keep_its_segment_mapped(pool):
    import gc
    import weakref

    if twophase.settings.sanitize:
        pytest.skip("the sanitizer keeps a freed block's guarded view for its later checks")
    b = pool.malloc(1 * MiB)
    b.data[:] = 1
    mapping = weakref.ref(b.segment.memory.base)  # the segment's mmap-backed array
    b.free()
    assert b.data is None  # the freed handle lives on (a freed tensor holds it)
    assert pool.empty_cache() > 0
    gc.collect()
    assert mapping() is None


def test_a_stream_of_another_device_is_refused_by_malloc_and_free(dev):
    """A stream's order says nothing about another device's memory: a free ordered on a NULL device's stream (always
    idle) handed a CPU block out while a CPU stream still wrote it."""
    other = twophase.device("null").stream()
    before = dev.pool.stats()
    with pytest.raises(twophase.ParamError, match="stream of device cpu") as e:
        dev.malloc(4096, stream=other)
    assert e.value.op == "malloc" and e.value.arg == "stream"
    assert dev.pool.stats()["alloc_count"] == before["alloc_count"]
    b = dev.malloc(4096)
    with pytest.raises(twophase.ParamError, match="stream of device cpu"):
        b.free(other)
    assert b.allocated  # refused before anything changed
    b.free()


def test_normal_only_policy_never_reports_huge_pages(pool):
    b = pool.malloc(4 * MiB, policy="normal_only")
    assert not b.segment.huge and pool.stats()["huge_page_reserved_bytes"] == 0
    b.free()


def test_huge_first_uses_huge_pages_where_the_os_allows(pool):
    b = pool.malloc(4 * MiB, policy="huge_first")
    s = pool.stats()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert b.segment.huge and s["huge_page_reserved_bytes"] == 4 * MiB
        assert b.segment.address % (2 * MiB) == 0
    else:
        assert s["huge_page_reserved_bytes"] == 0
    b.free()
    n = pool.malloc(4 * MiB, policy="normal_only")  # must not take the cached huge block
    assert not n.segment.huge
    n.free()
    pool.empty_cache()
    assert pool.stats()["huge_page_reserved_bytes"] == 0


def test_block_freed_on_a_stream_is_reused_at_once_by_that_stream(pool, dev, gate):
    s = dev.stream()
    ev = gate(s)
    try:
        a = pool.malloc(4096, stream=s)
        addr = a.address
        s.launch_callback(lambda: None)  # work on s still pending
        a.free(s)
        b = pool.malloc(4096, stream=s)
        assert b.address == addr
        b.free(s)
    finally:
        ev.set()
    s.synchronize()


def test_block_freed_on_a_stream_waits_for_its_work_before_another_stream_reuses_it(pool, dev, gate):
    s, t = dev.stream(), dev.stream()
    ev = gate(s)
    try:
        a = pool.malloc(4096, stream=s)
        addr = a.address
        a.free(s)
        other = pool.malloc(4096, stream=t)
        assert other.address != addr  # s has not reached the free yet
        nostream = pool.malloc(4096)
        assert nostream.address != addr
    finally:
        ev.set()
    s.synchronize()
    again = pool.malloc(4096, stream=t)
    assert again.address == addr
    for blk in (other, nostream, again):
        blk.free()


def test_a_tensor_freed_without_a_stream_waits_for_the_task_that_last_used_it(dev, gate):
    """``dev.tensor(a)`` enqueues its copy-in; ``free()`` at once must not hand the block to anyone before the copy
    has run (it would land in their memory)."""
    s, t = dev.stream(), dev.stream()
    ev = gate(s)
    try:
        x = dev.tensor(np.arange(1024, dtype=np.float32), stream=s)  # copy-in queued behind the gate
        addr = x.block.address
        x.free()
        others = [dev.malloc(4096, stream=t), dev.malloc(4096)]
        assert addr not in {b.address for b in others}
    finally:
        ev.set()
    s.synchronize()
    for b in others:
        b.free()


def test_pending_free_blocks_are_not_released_by_empty_cache(pool, dev, gate):
    s = dev.stream()
    ev = gate(s)
    try:
        a = pool.malloc(100, stream=s)
        a.free(s)
        assert pool.empty_cache() == 0 and pool.stats()["segments"] == 1
    finally:
        ev.set()
    s.synchronize()
    assert pool.empty_cache() == 2 * MiB


def test_device_empty_and_tensor_allocate_from_the_device_pool(dev, rng):
    before = dev.pool.stats()["alloc_count"]
    t = dev.tensor(rng.standard_normal(10))
    assert dev.pool.stats()["alloc_count"] == before + 1
    np.testing.assert_equal(t.numpy().shape, (10,))
    t.free(dev.default_stream)


def test_pool_is_thread_safe_under_concurrent_malloc_and_free(pool):
    errors = []

    def worker(seed):
        r = np.random.default_rng(seed)
        held = []
        try:
            for _ in range(300):
                if held and r.random() < 0.5:
                    b = held.pop(r.integers(len(held)))
                    assert (b.data[:8] == seed).all()  # nobody else was handed our block
                    b.free()
                else:
                    b = pool.malloc(int(r.integers(0, 300_000)))
                    b.data[:8] = seed
                    held.append(b)
            for b in held:
                b.free()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = pool.stats()
    assert s["allocated_bytes"] == 0 and s["requested_bytes"] == 0 and s["alloc_count"] == s["free_count"]
    assert pool.empty_cache() == s["reserved_bytes"] and pool.stats()["segments"] == 0


def test_a_miss_trims_a_cache_that_holds_more_than_is_allocated(pool):
    """Requests that drift upward in size, four live at a time: each size's freed blocks are too small for the
    next, so without a trim every miss reserved a new segment (reserved reached 7x allocated); a miss while the
    cache holds more than what is allocated (plus TRIM_SLACK) releases wholly free segments first."""
    from twophase.runtime.memory import TRIM_SLACK

    live: list = []
    worst = 0.0
    for i in range(300):
        live.append(pool.malloc((1 + i) * 64 * 1024))
        if len(live) > 4:
            live.pop(0).free()
        s = pool.stats()
        worst = max(worst, s["reserved_bytes"] - 2 * s["allocated_bytes"])
    assert worst <= TRIM_SLACK + 2 * 20 * MiB  # the slack, and the segment a request reserves on top
    assert pool.stats()["cache_trims"] > 0
    for b in live:
        b.free()


def test_a_dead_threads_default_stream_is_not_kept_alive_by_its_freed_blocks(dev):
    """A thread frees on its default stream while the stream still has work queued, then exits: the free-list
    nodes keep only the stream's queue, so the stream is collected and its worker thread ends (the nodes held
    the stream, and a server churning threads kept one worker thread per dead thread)."""
    import gc
    import time

    names: list[str] = []

    def work() -> None:
        s = dev.default_stream
        names.append(f"twophase-{s.name}")
        gate = threading.Event()
        s.launch_callback(gate.wait)  # the stream is busy when the block is freed
        b = dev.malloc(4096, stream=s)
        b.free(s)
        gate.set()
        s.synchronize()

    t = threading.Thread(target=work, name="short-lived")
    t.start()
    t.join()
    del t
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        gc.collect()
        if not any(th.name == names[0] for th in threading.enumerate()):
            break
        time.sleep(0.01)
    assert not any(th.name == names[0] for th in threading.enumerate())


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's memory mappings (Linux)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not __import__("os").path.exists("/proc/self/maps"),
    reason="reads /proc/self/maps (Linux)",
)
@pytest.mark.parametrize("how", ["one_shot", "plan", "two_parts", "copy_in"])
def test_empty_cache_unmaps_the_segments_that_launches_ran_on(dev, stream, how):
    """empty_cache gives memory back to the system, not only to the pool's counters, after ops ran on it: the
    launches the ops memoise, the stream worker's last task and a helper thread's last job held views of it, and a
    view keeps its segment mapped."""
    threads = twophase.settings.num_threads
    twophase.set_num_threads(2)  # exp of 40 MiB runs in two parts, one on a helper thread
    dev.pool.empty_cache()  # no cached segment to put the tensors in: each gets one of its own
    # larger than all the free memory left in segments that blocks of earlier tests still pin (their holes)
    rows = 10240 + dev.pool.stats()["cached_bytes"] // 4096 + 1
    try:
        x = dev.tensor(np.full((rows, 1024), -1.5, np.float32), stream=stream)
        if how == "copy_in":
            y = dev.tensor(np.full((rows, 1024), 2.5, np.float32), stream=stream)
        elif how == "plan":
            y = dev.empty((rows, 1024), stream=stream)
            with twophase.plan("relu", x, out=y, stream=stream) as call:
                call()
        else:
            y = twophase.relu(x, stream=stream) if how == "one_shot" else twophase.exp(x, stream=stream)
        want = {"copy_in": 2.5, "two_parts": np.exp(np.float32(-1.5))}.get(how, 0.0)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)
        addresses = [x.block.segment.address, y.block.segment.address]
        assert all(_mapped(a) for a in addresses)
        x.free(stream)
        y.free(stream)
        stream.synchronize()
        assert dev.pool.empty_cache() >= 2 * rows * 4096
        del x, y
        assert not any(_mapped(a) for a in addresses)
    finally:
        twophase.set_num_threads(threads)


def test_a_block_taken_in_its_streams_order_keeps_the_pending_free(dev, gate):
    """Memory freed in stream A's order and taken again on A while that free is pending: freed again without a
    stream (a zero-element tensor: nothing marks it), it went to another stream while A's copy still wrote it."""
    a, b = dev.stream(), dev.stream()
    try:
        opened = gate(a)
        x = dev.tensor(np.full(64, 7, np.float32), stream=a)
        x.free(a)
        z = dev.tensor(np.zeros(0, np.float32), stream=a)
        z.free()
        y = dev.tensor(np.ones(64, np.float32), stream=b)
        b.synchronize()
        opened.set()
        a.synchronize()
        np.testing.assert_array_equal(y.numpy(), np.ones(64))
        y.free()
    finally:
        a.close()
        b.close()


def test_a_copy_in_whose_enqueue_raises_leaves_nothing_allocated(dev):
    """Launch blocking turned on after a failure: the copy-in's enqueue raises that failure, and the block made
    for the tensor was never returned."""
    s = dev.stream()
    s.launch_callback(lambda: 1 / 0)
    s._q.drain()
    before = dev.pool.stats()["allocated_bytes"]
    twophase.set_launch_blocking(True)
    try:
        with pytest.raises(twophase.KernelError, match="ZeroDivisionError"):
            dev.tensor(np.ones(1000, np.float32), stream=s)
    finally:
        twophase.set_launch_blocking(False)
    assert dev.pool.stats()["allocated_bytes"] == before
    s.close()


def test_out_of_memory_waits_for_the_pending_stream_ordered_frees_and_retries(pool, dev, gate):
    """A block freed on the host while its last use on a stream was still queued: malloc raised out of memory
    instead of waiting for that use, as CUDA's and PyTorch's allocators synchronize before they give up."""
    s = dev.stream()
    pool.set_limit(4 * MiB)
    opened = gate(s)
    a = pool.malloc(3 * MiB)
    addr = a.address
    a.mark_use(s, s._submitted)  # the gate's task uses it, as a launch marks its operands
    a.free()
    got = []

    def take():
        try:
            got.append(pool.malloc(3 * MiB))
        except twophase.OutOfMemoryError as e:
            got.append(e)

    t = threading.Thread(target=take, daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 10
        while not s._q.waiting and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        opened.set()
    t.join(30)  # a hang guard, not a timing check
    assert not t.is_alive() and len(got) == 1
    assert not isinstance(got[0], Exception), got[0]
    assert got[0].address == addr and pool.stats()["reserved_bytes"] == 4 * MiB
    got[0].free()
    s.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_out_of_memory_in_a_callback_does_not_wait_for_its_own_streams_pending_free(pool, dev, blocking):
    """The pending free is the callback's own stream's: waiting for it would wait for the callback itself."""
    s = dev.stream()
    pool.set_limit(4 * MiB)
    a = pool.malloc(3 * MiB)
    outcome = []

    def cb():
        a.free(s)  # pending until this very callback has run
        try:
            pool.malloc(3 * MiB)
            outcome.append("allocated")
        except twophase.OutOfMemoryError:
            outcome.append("out of memory")

    assert ran_without_hanging(s, lambda: (s.launch_callback(cb), s.synchronize()), blocking)
    assert outcome == ["out of memory"]
    pool.malloc(3 * MiB).free()  # the free has completed since: its memory is taken again
    s.close()
