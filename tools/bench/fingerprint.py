"""What keying a model by every byte of its files costs at load (issue 41):

    kvstore bench fingerprint --gb 16 --dir DIR [--out docs/bench/fingerprint.json]

Writes an 8B-fp16-sized model folder under DIR (``--shards`` safetensors
files of random bytes and a config.json; content does not change the speed),
then times ``model_fingerprint`` of it: the first time with the files cold
(page cache dropped: needs root; else ``null``), the first time with them in
the page cache, and remembered (a restart: no file read). Beside each, the
plain read of the same files (``cat`` to /dev/null) in the same run, and
xxh3-128's speed over a loaded model's parameters in memory
(``loaded_model_fingerprint``, a path-less model or a draft), from a 1 GiB
array. Two plain reads: ``cat`` (one file after another, small reads) and
``parallel_read`` (the fingerprint's own pattern: the shards side by side in
16 MiB reads, nothing hashed). The folder is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

CHUNK = 64 << 20


def _write_shard(path: Path, nbytes: int, rng: np.random.Generator) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left = nbytes
        while left:
            n = min(CHUNK, left)
            f.write(rng.bytes(n))
            left -= n
        os.fsync(f.fileno())


def _drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _in_memory_gbps() -> float:
    import mlx.core as mx
    import xxhash

    a = mx.ones((1 << 29,), mx.float16)  # 1 GiB
    mx.eval(a)
    view = memoryview(a).cast("B")
    t = time.perf_counter()
    xxhash.xxh3_128_digest(view)
    return (1 << 30) / (time.perf_counter() - t) / 1e9


def run(gb: float, root: Path, shards: int) -> dict:
    from kvstore.adapters.mlx_lm import model_fingerprint

    folder = root / "fingerprint-cost-model"
    folder.mkdir(parents=True, exist_ok=False)
    rng = np.random.default_rng(0)
    total = int(gb * 1e9)
    try:
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        files = [folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        write_s = sum(_timed(lambda p=p: _write_shard(p, total // shards, rng)) for p in files)
        nbytes = sum(p.stat().st_size for p in files)
        cat = ["cat", *map(str, files)]

        def read():
            subprocess.run(cat, stdout=subprocess.DEVNULL, check=True)

        def parallel_read():
            def one(p):
                buf = bytearray(16 << 20)
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass

            with ThreadPoolExecutor(min(4, len(files))) as pool:
                list(pool.map(one, files))

        def fingerprint(memory: str) -> None:
            os.environ["KVSTORE_CACHE_DIR"] = memory
            model_fingerprint(folder)

        time.sleep(2.5)  # older than the digest memory's settle time, as a model's files are
        res: dict = {"bytes": nbytes, "files": shards, "write_s": round(write_s, 2)}
        with tempfile.TemporaryDirectory() as m1, tempfile.TemporaryDirectory() as m2:
            cold = _drop_caches()
            res["cold_cat_s"] = round(_timed(read), 2) if cold else None
            if cold:
                _drop_caches()
                res["cold_parallel_read_s"] = round(_timed(parallel_read), 2)
                _drop_caches()
            res["cold_first_fingerprint_s"] = round(_timed(lambda: fingerprint(m1)), 2) if cold else None
            read()  # into the page cache (if it fits)
            res["cached_cat_s"] = round(_timed(read), 2)
            res["cached_parallel_read_s"] = round(_timed(parallel_read), 2)
            res["cached_first_fingerprint_s"] = round(_timed(lambda: fingerprint(m2)), 2)
            res["remembered_fingerprint_s"] = round(_timed(lambda: fingerprint(m2)), 4)
        gbps = _in_memory_gbps()
        res["in_memory_xxh3_gbps"] = round(gbps, 2)
        res["in_memory_fingerprint_s_estimated"] = round(nbytes / 1e9 / gbps, 2)
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kvstore bench fingerprint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=16.0, help="total size of the weight files (GB, 1e9 bytes)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", type=Path, required=True, help="where to write them (a disk like a model's)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/fingerprint.json"))
    a = ap.parse_args(argv)
    res = run(a.gb, a.dir, a.shards)
    res["machine"] = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"
    res["command"] = "kvstore bench fingerprint " + " ".join(sys.argv[1:] if argv is None else argv)
    res["date"] = time.strftime("%Y-%m-%d")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
