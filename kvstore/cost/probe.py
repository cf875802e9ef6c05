"""Priors for the load rates, so ``fetch_policy="auto"`` decides well from the
first request, before any fetch has been measured.

Without them auto served every hit until each tier's rate was measured, and
the first cold-SSD hit of an 8B fp16 prompt on an H100 took 2.5x a cold
prefill (issue 28). A served hit that loses costs more than cold, a declined
one at most cold, so where the prior is unsure it errs toward declining.

Each prior times the steps a hit from that state takes, once per machine and
store (``Planner`` keeps them with the measured rates; any real measurement
replaces a prior, and the decision rule is the same for both):

- ``ram``: host bytes into an mlx array ready on the default device (on a GPU
  that includes the move to the device, which a hit pays in the engine's first
  forward);
- ``ssd_cached``: a copy out of the page cache (timed as a host memcpy), then
  the arrays, in series;
- ``ssd_cold``: the store's own file read around the page cache (``O_DIRECT``,
  ``F_NOCACHE`` on macOS: dropping its pages would take them from whoever
  else reads the file) on a few threads, then the arrays, in series, scaled
  by ``StoreConfig.prior_cold_share``. A direct read runs below the
  buffered, read-ahead reads of a cold fetch, so this errs toward declining.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

if TYPE_CHECKING:
    from ..gpu.backend import Backend

_CHUNK = 4 << 20  # bytes per direct read: a request size the store's own cold reads reach


def _slower_of_two(run: Callable[[], None]) -> float:
    """Seconds of the slower of two timed runs, after an untimed one."""
    run()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return max(times)


def array_rate(nbytes: int, backend: Optional[Backend] = None) -> float:
    """Bytes/s from host memory to an mlx array evaluated on ``backend``
    (default: ``choose()``): where arrays live apart (CUDA) the route a RAM
    hit takes (page-locked bytes into a device buffer on the copy engine),
    elsewhere a host array into mlx."""
    import mlx.core as mx

    from ..gpu import cuda
    from ..gpu.backend import choose
    rt = (backend or choose()).runtime
    if rt is not None:
        pinned = rt.pinned(nbytes)
        pinned[:] = 1
        dev = mx.zeros((nbytes,), mx.uint8)
        mx.eval(dev)
        mx.synchronize()
        at = cuda.address(dev)
        return nbytes / _slower_of_two(lambda: cuda.upload_pinned(rt, [(at, memoryview(pinned))]))
    host = np.ones(max(1, nbytes // 4), dtype=np.uint32)  # touched: fresh pages would time zero-filling

    def run():  # a sum reads every byte where the engine will (an fp16 sum is 7x slower on a CPU than this)
        mx.eval(mx.sum(mx.array(host)))
    return host.nbytes / _slower_of_two(run)


def copy_rate(nbytes: int) -> float:
    """Bytes/s of a host memcpy (what reading page-cached bytes costs), in
    pieces on the store's worker threads, as a page-cached hit copies them."""
    from ..convert.spread import each, workers
    n = workers()
    src = np.ones(max(n, nbytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    dst[:] = 1
    cuts = [len(src) * i // n for i in range(n + 1)]

    def run():
        each(lambda i: np.copyto(dst[cuts[i] : cuts[i + 1]], src[cuts[i] : cuts[i + 1]]), n)
    return src.nbytes / _slower_of_two(run)


def direct_read_rate(path: Path, nbytes: int, threads: int = 4) -> Optional[float]:
    """Bytes/s reading up to ``nbytes`` of ``path``'s written pages from the
    device, not the page cache, on ``threads`` threads as the store's cold
    reads do (``_CHUNK`` a request); ``None`` where that cannot be done
    (tmpfs, no ``O_DIRECT``) or the file holds less than a request a thread."""
    from concurrent.futures import ThreadPoolExecutor
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDONLY | direct)
    except OSError:
        return None
    try:
        if not direct:
            import fcntl
            if not hasattr(fcntl, "F_NOCACHE"):
                return None
            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        st = os.fstat(fd)
        size = min(nbytes, st.st_size, st.st_blocks * 512) // (_CHUNK * threads) * _CHUNK * threads
        if size < _CHUNK * threads:  # (only written pages: not a hole)
            return None

        def read(part: int) -> int:
            with mmap.mmap(-1, _CHUNK) as buf:  # page-aligned, as O_DIRECT wants
                done, end = part * size // threads, (part + 1) * size // threads
                got = 0
                while done < end:
                    n = os.preadv(fd, [buf], done)
                    if n <= 0:
                        break
                    done, got = done + n, got + n
                return got

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(read, range(threads)))
        seconds = time.perf_counter() - t
        return done / seconds if done >= _CHUNK and seconds > 0 else None
    except OSError:
        return None
    finally:
        os.close(fd)


def in_series(*rates: float) -> float:
    """The rate of steps done one after the other."""
    return 1.0 / sum(1.0 / r for r in rates)
