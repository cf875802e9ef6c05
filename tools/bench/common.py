"""What every benchmark shares: timing, the baselines (memcpy, a plain file
read or write, the page cache), synthetic tokens and KV, the tiny models, and
a description of the machine."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

GiB = 1 << 30
MiB = 1 << 20

# ----------------------------------------------------------------------- timing


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(path: Optional[Path], obj) -> None:
    """``obj`` as indented JSON at ``path`` (its folder made), where a path is given."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=1))


def splice(path: Path, markers: tuple[str, str], block: str) -> None:
    """``block`` (which starts and ends with ``markers``) in place of the marked section of the page at
    ``path``, the rest of the page kept; appended where the page has no such section (or no page)."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if markers[0] in text and markers[1] in text:
        text = text[: text.index(markers[0])] + block + text[text.index(markers[1]) + len(markers[1]):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def record(path: Path, key: str, obj) -> None:
    """``obj`` under ``key`` in the JSON object at ``path``, its other keys kept
    (a file of docs/bench holds a benchmark's runs side by side)."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[key] = obj
    write_json(path, doc)


def med(ts) -> float:
    return float(np.median(ts)) if len(ts) else float("nan")


def pct(xs, q: float) -> float:
    """The ``q``-th percentile of ``xs`` (0 for none)."""
    return float(np.percentile(xs, q)) if len(xs) else 0.0


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 0,
          setup: Optional[Callable[[], Any]] = None, teardown: Optional[Callable[[Any], None]] = None) -> list[float]:
    """Wall times of ``fn`` (results dropped after each call, outside the timing)."""
    ts = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        if teardown is not None:
            teardown(r)
        del r
        if i >= warmup:
            ts.append(dt)
    return ts


def stat(ts: list[float], nbytes: Optional[int] = None) -> dict:
    out = {"median_s": med(ts), "times_s": [round(t, 6) for t in ts]}
    if nbytes is not None:
        out["gbps"] = nbytes / out["median_s"] / 1e9 if out["median_s"] > 0 else float("inf")
    return out


# ------------------------------------------------------------ page cache, files


def drop_page_cache(path: Path) -> None:
    """Evict a file's pages from the page cache (it must not be mapped)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float:
    """Fraction of a file's pages in the page cache (mincore on a fresh read-only map)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        view = np.frombuffer(m, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
        if rc != 0:
            return float("nan")
        return sum(v & 1 for v in vec) / n
    finally:
        m.close()


@contextlib.contextmanager
def lmdb_readahead(enabled: bool):
    """Open LMDB environments with ``readahead=enabled`` (bench-only experiment:
    kvstore/tiers/disk/lmdb_env.py chooses its own flag)."""
    import lmdb

    orig = lmdb.open

    def patched(*a, **kw):
        kw["readahead"] = enabled
        return orig(*a, **kw)

    lmdb.open = patched
    try:
        yield
    finally:
        lmdb.open = orig


def lmdb_readahead_flag(tmp: Path) -> Optional[bool]:
    """Whether kvstore's LMDB tier opens its environment with readahead."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    t = LmdbTier(tmp / "flag-probe", 64 << 20)
    try:
        return bool(t.env.flags().get("readahead"))
    finally:
        t.close()
        shutil.rmtree(tmp / "flag-probe", ignore_errors=True)


def read_ahead_kb(path: Path) -> Optional[int]:
    """The block device's read_ahead_kb under ``path`` (Linux), if found."""
    try:
        dev = os.stat(path).st_dev
        sysdir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        for q in (sysdir / "queue", sysdir.resolve().parent / "queue"):
            f = q / "read_ahead_kb"
            if f.exists():
                return int(f.read_text())
    except (OSError, ValueError):
        pass
    return None


def page_facts() -> dict:
    """The memory page size and the transparent-huge-page mode (Linux), which
    decide how many page faults fresh buffers take."""
    import mmap

    thp = None
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        thp = text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        pass
    return {"page_size": mmap.PAGESIZE, "transparent_hugepage": thp}


def plain_read(path: Path, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(buf)
        got = 0
        while got < nbytes:
            n = f.readinto(mv[got:])
            if not n:
                break
            got += n
    return buf


WRITE_CHUNK = 64 * MiB


@functools.lru_cache(maxsize=2)
def random_chunk(nbytes: int) -> bytes:
    """Random bytes, made once per size (call before timing a write_file)."""
    return np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def write_file(path: Path, nbytes: int, chunk: int = WRITE_CHUNK, append: bool = False) -> None:
    """Write ``nbytes`` of random bytes to ``path`` and fsync: the plain
    write baseline. The bytes are made once per chunk size and written from
    memoryview slices, so a timed call is the write and the fsync alone
    (making them in the call, and slicing ``bytes``, once added ~0.1 s per
    256 MiB to the baseline here)."""
    block = memoryview(random_chunk(min(chunk, nbytes)))
    with open(path, "ab" if append else "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def timed_write(path: Path, nbytes: int) -> float:
    """Seconds of a ``write_file`` of ``nbytes`` to ``path`` (removed after)."""
    t = time.perf_counter()
    write_file(path, nbytes)
    secs = time.perf_counter() - t
    path.unlink()
    return secs


def memcpy_baselines(nbytes: int, repeats: int) -> dict:
    """numpy copy (alloc + memcpy) and numpy -> mx.array copy of ``nbytes``."""
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    np_t = timed(lambda: src.copy(), repeats, warmup=1)

    def to_mx():
        a = mx.array(src.view(np.float16))
        mx.eval(a)
        return a

    mx_t = timed(to_mx, repeats, warmup=1)
    return {"numpy_copy": stat(np_t, nbytes), "mx_array_copy": stat(mx_t, nbytes)}


# ------------------------------------------------------------ tokens and KV


def rand_tokens(rng: np.random.Generator, n: int, hi: int = 1000) -> np.ndarray:
    return rng.integers(5, hi, n).astype(np.int32)


def kv_layers(rng: np.random.Generator, layers: int, heads: int, dim: int, tokens: int, distinct: bool = True):
    """``layers`` KVLayers of fp16 normal noise (``distinct=False`` shares one K/V pair)."""
    from kvstore.blocks.layers import KVLayer

    def one():
        a = rng.standard_normal((1, heads, tokens, dim), dtype=np.float32).astype(np.float16)
        x = mx.array(a)
        mx.eval(x)
        return x

    if not distinct:
        k, v = one(), one()
        return [KVLayer(k, v) for _ in range(layers)]
    return [KVLayer(one(), one()) for _ in range(layers)]


def fp16_nbytes(layers) -> int:
    return sum(l.nbytes for l in layers)


def restore_workload(cfg: dict):
    """The restore part's prompt (seed 10): its settings, fp16 layers, tokens and their bytes."""
    c = cfg["restore"]
    rng = np.random.default_rng(10)
    layers = kv_layers(rng, c["layers"], c["heads"], c["dim"], c["tokens"])
    return c, layers, rand_tokens(rng, c["tokens"], 100_000), fp16_nbytes(layers)


# ------------------------------------------------------------------ models

_MODELS: dict[str, tuple] = {}


def load_tiny(kind: str):
    """(model, tokenizer, path) of a tiny fixed-seed model, built once."""
    if kind not in _MODELS:
        import mlx_lm

        from kvstore.adapters.tiny_models import ensure_tiny_model

        path = ensure_tiny_model(kind)  # max_position_embeddings 32768: enough for the 16K ttft prompts
        model, tok = mlx_lm.load(str(path))
        _MODELS[kind] = (model, tok, path)
    return _MODELS[kind]


def kv_shape(model) -> tuple[int, int, int, mx.Dtype]:
    """(layers, KV heads, head dim, dtype) of a plain-attention model."""
    a = model.args
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    return a.num_hidden_layers, a.num_key_value_heads, head_dim, model.model.embed_tokens.weight.dtype


def describe_model(kind: str, model) -> tuple[str, int]:
    """A plain-attention model in words, and its KV bytes per token."""
    layers, heads, dim, dtype = kv_shape(model)
    name = str(dtype).split(".")[-1]
    words = f"tiny {kind} ({layers} layers, {heads} KV head{'s' * (heads != 1)}, head_dim {dim}, {name})"
    return words, 2 * layers * heads * dim * dtype.size


def run_tokens(model, cache, toks, step: int = 2048, logits: bool = True):
    """Feed ``toks`` into ``cache``; logits of the last position (float32).

    As mlx-lm's prefill: chunks before the last token only evaluate the cache
    (the lm head never runs on them), the last token gives the logits."""
    toks = np.asarray(toks, dtype=np.int32)
    body = toks[:-1] if logits else toks
    for i in range(0, len(body), step):
        model(mx.array(body[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    if not logits:
        return None
    out = model(mx.array(toks[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
    mx.eval(out)
    return out


# ------------------------------------------------------------------ machine


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{mem}"


def mlx_speed(c: dict, repeats: int) -> dict:
    """How fast mlx's own kernels run here, to read absolute figures by: an
    fp16 add (GB/s of both inputs and the output) and a float32 matmul
    (GFLOP/s), with numpy's matmul on the same operands as the yardstick."""
    n, m = c["add_elements"], c["matmul"]
    a, b = (mx.random.normal((n,), key=mx.random.key(i)).astype(mx.float16) for i in (1, 2))
    x, y = (mx.random.normal((m, m), key=mx.random.key(i)) for i in (3, 4))
    mx.eval(a, b, x, y)

    def run(f):
        def go():
            r = f()
            mx.eval(r)
            return r
        return med(timed(go, repeats, warmup=1))

    xn, yn = np.array(x), np.array(y)
    flops = 2 * m ** 3
    return {"device": str(mx.default_device().type).split(".")[-1], "fp16_add_gbps": 3 * 2 * n / run(lambda: a + b) / 1e9,
            "matmul_gflops": flops / run(lambda: x @ y) / 1e9,
            "numpy_matmul_gflops": flops / med(timed(lambda: xn @ yn, repeats, warmup=1)) / 1e9,
            "matmul_size": m}


def cold_ttft(model, tok, prompt: list[int], repeats: int) -> tuple[list[float], Any, int]:
    """Plain mlx-lm's time to first token, ``repeats`` times: (times, the
    last run's cache, evaluated, and the token it generated)."""
    import mlx_lm
    from mlx_lm.models import cache as C

    times, cache, first = [], None, None
    for _ in range(repeats):
        cache = C.make_prompt_cache(model)
        t0 = time.perf_counter()
        for resp in mlx_lm.stream_generate(model, tok, prompt, max_tokens=1, prompt_cache=cache):
            times.append(time.perf_counter() - t0)
            first = resp.token
            break
    mx.eval([c.state for c in cache])
    return times, cache, first
