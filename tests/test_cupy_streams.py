"""``on_stream`` (runtime/devices/cupy_streams.py) on the CPU stand-in for CuPy: the stream current
before the block is current after it, also where it was made current by ``use()`` (CuPy 14's own
``with stream:`` left the null stream current there, and work issued next ran unordered)."""

from bench import fake_cupy
from blasx.runtime.devices.cupy_streams import on_stream


def test_the_stream_made_current_by_use_is_current_again_after_the_block():
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        mine, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        mine.use()
        with on_stream(other) as st:
            assert st is other and cupy.cuda.get_current_stream() is other
        assert cupy.cuda.get_current_stream() is mine
        with on_stream(mine):  # already current: left as it is
            assert cupy.cuda.get_current_stream() is mine
        assert cupy.cuda.get_current_stream() is mine


def test_an_error_in_the_block_gives_the_stream_back_too():
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        mine, other = cupy.cuda.Stream(), cupy.cuda.Stream()
        before = cupy.cuda.get_current_stream()
        with mine:
            try:
                with on_stream(other):
                    raise KeyError("x")
            except KeyError:
                pass
            assert cupy.cuda.get_current_stream() is mine
        assert cupy.cuda.get_current_stream() is before


def test_stream_key_tells_threads_apart_only_on_per_thread_handles():
    """cudaStreamPerThread's handle (2) is another stream in each thread: its key carries the thread; any other
    handle's key is the handle alone."""
    import threading

    from blasx.runtime.devices.cupy_streams import PER_THREAD, stream_key
    assert 2 in PER_THREAD and stream_key(7) == (7, 0)
    here, there = stream_key(2), []
    t = threading.Thread(target=lambda: there.append(stream_key(2)))
    t.start()
    t.join()
    assert here == (2, threading.get_ident()) and there[0][0] == 2 and there[0] != here
