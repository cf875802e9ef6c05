"""Opens a kvstore store's LMDB environment directly, begins a write
transaction (taking LMDB's writer lock), writes into it, prints "locked" and
sleeps until killed: the parent SIGKILLs it while it holds the lock.

Usage: child_hold_lock.py SSD_PATH
"""

import sys
import time

import lmdb

env = lmdb.open(sys.argv[1], max_dbs=8, map_size=64 << 20)
blocks = env.open_db(b"blocks", create=False)
txn = env.begin(write=True)
txn.put(b"half-written", b"x" * 100_000, db=blocks)
print("locked", flush=True)
time.sleep(600)
