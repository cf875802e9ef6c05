"""Remote tier: blocks on a Redis / Valkey server or cluster, shared by hosts.

Each block is one Redis hash, ``kvstore:v1:<namespace>:{<block key hex>}``:

- ``p``: the block's bytes, exactly as the LMDB tier keeps them (header,
  checksum, key binding), so a corrupt or foreign value is refused on read;
- ``r``: its ``BlockRecord`` (parent, position, tokens, servability), so a
  host that never saw the block can index it;
- ``m``: its model root key, so ``kvstore stats/clear --remote`` can act on
  one model's blocks without reading records;
- ``a``: written only by a store with ``remote_secret``: the block's keyed
  MAC (``remote_auth``), checked on read by stores with the secret.

One key per block keeps payload and record together under Redis's own
eviction (``allkeys-lru`` drops both or neither) and in one cluster slot.

Beside them, per parent block, a sorted set of its children,
``kvstore:v1:<namespace>:kids:<root hex>:{<parent key hex>}``, whose members
are each child's tokens (8 bytes each, big-endian) followed by its key. A prompt whose block ends or diverges inside a stored block cannot
compute that block's key; but the stored child sharing the longest prefix
with the prompt's tokens is always a lexicographic neighbour of them, so two
``ZRANGEBYLEX`` calls find it, in the same round trip as the records. A
listing evicted or stale only loses partial matches (a missing child's
member is removed when found).

No command spans two keys, so a Redis Cluster needs nothing more. Keys carry
the store's namespace in clear text, so Redis ACL key patterns can fence
tenants sharing one server; the block keys themselves are salted by the
namespace already (``hashing.root_key``).

The tier only keeps, finds and counts; payload reads are parsed by ``resp`` (each lands once, in a reused
buffer). It never decides when to call the server; ``remote_sync.Remote`` guards every call with timeouts
and a breaker, so nothing here has to be careful about a slow or absent server.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Iterator, Optional, Sequence

import msgpack
import numpy as np

from ...background import Pools
from ...errors import RemoteConfigError
from ...blocks.record import BlockRecord, Entry
from ...blocks.wire import Stored
from .auth import Signer
from .resp import ahead, streamed
from .url import PASSWORD_ENV, RemoteURL, namespace_tag

PREFIX = b"kvstore:v1:"  # v1: block bytes of wire format 2 and records of record.RECORD_VERSION 1
FIELD_PAYLOAD, FIELD_RECORD, FIELD_ROOT, FIELD_TAG = b"p", b"r", b"m", b"a"
class RemoteTier:
    """Blocks in Redis. ``connect`` opens the clients (a cluster is detected);
    every other method assumes it did and lets the client's errors through.
    With ``secret``, blocks are written with their MAC and read back with it checked (``entries``)."""

    name = "remote"  # a ``Tier`` (``tiers.base``); the store reads it in pipelined batches (``entries``)

    def __init__(self, url: str, namespace: Optional[str] = None, timeout: float = 0.5,
                 write_timeout: float = 10.0, read_bytes: int = 16 << 20, secret: Optional[bytes] = None):
        self.url = RemoteURL.parse(url)
        self.signer = Signer(secret) if secret else None
        self.namespace = namespace
        self.ns = namespace_tag(namespace).encode()
        self.timeout = timeout
        self.write_timeout = write_timeout
        self.read_bytes = read_bytes  # payload bytes per read round trip (``_read_each``)
        self._connecting = threading.Lock()
        self.reads = None  # short socket timeouts: the engine waits on these
        self.writes = None  # longer ones: large background batches
        self.cluster = False
        # threads of ``entries``: "read" reads ahead of the caller, "mac" checks MACs beside both
        self._pools = Pools("kvstore-remote-")

    # ---------------------------------------------------------- connection

    @property
    def connected(self) -> bool:
        return self.reads is not None

    def connect(self) -> None:
        """Open both clients and check the credentials. Raises
        ``RemoteConfigError`` for refused credentials or a missing client
        library; connection errors pass through (the caller retries later)."""
        with self._connecting:
            if not self.connected:
                self._connect()

    def _connect(self) -> None:
        try:
            import redis
        except ImportError:
            raise RemoteConfigError(f"remote={self.url.shown} needs the Redis client: "
                                    f"pip install 'kvstore[remote]'") from None
        try:
            probe = self._client(redis, self.timeout, cluster=False)
            try:
                try:  # (connecting authenticates: refused credentials raise here)
                    self.cluster = bool(probe.info("cluster").get("cluster_enabled"))
                except redis.exceptions.NoPermissionError:
                    self.cluster = False  # a user without INFO (an ACL): taken for a single server
            finally:
                probe.close()
            if self.cluster and self.url.db:
                raise RemoteConfigError(f"remote URL {self.url.shown}: a Redis Cluster has only database 0")
            reads, writes = (self._client(redis, t, self.cluster) for t in (self.timeout, self.write_timeout))
        except redis.AuthenticationError as e:
            raise RemoteConfigError(f"remote {self.url.shown} refused the credentials ({e}); set the password "
                                    f"in the URL or in ${PASSWORD_ENV[0]}") from None
        except redis.ResponseError as e:
            if _is_auth(e):
                raise RemoteConfigError(f"remote {self.url.shown} refused the credentials ({e}); set the password "
                                        f"in the URL or in ${PASSWORD_ENV[0]}") from None
            raise
        except Exception as e:
            if _is_auth(e):  # a cluster client wraps what its nodes said
                raise RemoteConfigError(f"remote {self.url.shown} refused the credentials ({e})") from None
            if "certificate verify failed" in str(e).lower():
                raise RemoteConfigError(f"remote {self.url.shown}: the server's TLS certificate is not trusted ({e}); "
                                        f"give the CA that signed it as ?ssl_ca_certs=/path/ca.pem") from None
            raise
        self.close()
        self.reads, self.writes = reads, writes

    def _client(self, redis, timeout: float, cluster: bool):
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        u = self.url
        common = dict(username=u.username, password=u.password, socket_timeout=timeout,
                      socket_connect_timeout=self.timeout, socket_read_size=1 << 20, retry=Retry(NoBackoff(), 0))
        if u.scheme == "unix":
            return redis.Redis(unix_socket_path=u.socket_path, db=u.db, **common)
        if u.scheme == "rediss":  # (redis-py before 6 did not check the host name by default)
            common.update(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=True, **dict(u.tls))
        if cluster:
            from redis.cluster import RedisCluster

            return RedisCluster(host=u.host, port=u.port, require_full_coverage=False, **common)
        return redis.Redis(host=u.host, port=u.port, db=u.db, **common)

    def close(self) -> None:
        self._pools.shutdown(wait=True)
        for c in (self.reads, self.writes):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    pass
        self.reads = self.writes = None

    # ----------------------------------------------------------------- names

    def key_name(self, key: bytes) -> bytes:
        return PREFIX + self.ns + b":{" + key.hex().encode() + b"}"

    def models_name(self) -> bytes:
        return PREFIX + self.ns + b":models"

    def kids_name(self, root: bytes, parent: bytes) -> bytes:
        return PREFIX + self.ns + b":kids:" + root.hex().encode() + b":{" + parent.hex().encode() + b"}"

    # ---------------------------------------------------------------- blocks

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Delete blocks (UNLINK: freed by the server in the background)."""
        if not keys:
            return []
        return [k for k, n in zip(keys, self._each(self.reads, "unlink", [self.key_name(k) for k in keys])) if n]

    def get(self, key: bytes) -> Optional[Stored]:
        for raw, payload, authentic in self.entries([key]):
            rec = BlockRecord.unpack(key, raw) if isinstance(raw, bytes) else None
            if rec is None or not isinstance(payload, (bytes, memoryview)) or authentic is False:
                return None
            return Stored.of(payload, key, rec.start).held()
        return None

    def put(self, entries: Sequence[Entry]) -> int:
        self.put_many([(e.record, e.payload) for e in entries])
        return len(entries)

    def contains(self, key: bytes) -> bool:
        return isinstance(self.records([key])[0], bytes)

    def records(self, keys: Sequence[bytes]) -> list:
        """Each block's packed record: bytes, ``None`` when absent, or the exception the server returned for that
        key (a foreign value)."""
        return self._each(self.reads, "hget", [self.key_name(k) for k in keys], FIELD_RECORD)

    def probe(self, root: bytes, keys: Sequence[bytes], near: Optional[tuple[bytes, np.ndarray]] = None):
        """One round trip: the records of ``keys`` (as ``records``) and, with ``near=(parent, tokens)``, the
        children of ``parent`` nearest to ``tokens`` (as ``neighbours``; ``None`` without ``near``)."""
        pipe = self.reads.pipeline(transaction=False)
        for k in keys:
            pipe.hget(self.key_name(k), FIELD_RECORD)
        if near is not None:
            self._near(pipe, root, *near)
        res = _per_key(pipe.execute(raise_on_error=False))
        return res[: len(keys)], None if near is None else _children(res[len(keys):])

    def neighbours(self, root: bytes, parent: bytes, tokens: np.ndarray) -> list[tuple[bytes, np.ndarray, bytes]]:
        """``(key, tokens, member)`` of the stored children of ``parent`` that sort next to ``tokens``: the one
        sharing the longest prefix with them is among these."""
        pipe = self.reads.pipeline(transaction=False)
        self._near(pipe, root, parent, tokens)
        return _children(_per_key(pipe.execute(raise_on_error=False)))

    def _near(self, pipe, root: bytes, parent: bytes, tokens: np.ndarray) -> None:
        name, q = self.kids_name(root, parent), _member(tokens, b"")
        pipe.zrangebylex(name, b"[" + q, b"+", 0, 1)
        pipe.zrevrangebylex(name, b"(" + q, b"-", 0, 1)

    def forget_child(self, root: bytes, parent: bytes, member: bytes) -> None:
        self.reads.zrem(self.kids_name(root, parent), member)

    def entries(self, keys: Sequence[bytes], sizes: Optional[Sequence[int]] = None) -> Iterator[tuple]:
        """``(record, payload, authentic)`` of each block (record and payload as ``records``), handed over as
        soon as it is parsed while a second thread reads the next ones (``_read_each``). With a secret, a
        third thread checks each block's MAC as it comes in (``authentic``; None without a secret), so the
        read, the MACs and the caller's work on the blocks overlap. A caller that stops early stops the read."""
        fields = (FIELD_RECORD, FIELD_PAYLOAD) + ((FIELD_TAG,) if self.signer else ())
        replies = ahead(self._pools.get("read"), self._checking(keys, self._read_each("hmget", keys, sizes, *fields)))
        return ((record, payload, None if ok is None else ok.result()) for record, payload, ok in replies)

    def _checking(self, keys: Sequence[bytes], replies: Iterator) -> Iterator[tuple]:
        """``replies`` as ``(record, payload, the future of its MAC check or None)``."""
        macs = None if self.signer is None else self._pools.get("mac")
        try:
            for key, r in zip(keys, replies):
                record, payload, *tag = r if isinstance(r, list) else (r, r, r)
                yield record, payload, None if macs is None else macs.submit(self.signer.valid, key, record,
                                                                             payload, tag[0] if tag else None)
        finally:
            replies.close()  # (a read stopped early drops its connection now: ``streamed``)

    def _read_each(self, command: str, keys: Sequence[bytes], sizes: Optional[Sequence[int]], *args) -> Iterator:
        """``_each`` of ``keys`` on ``reads`` for replies holding payloads, in round trips of about
        ``read_bytes`` (when ``sizes`` are known), the next one sent before this one is read; each reply is
        handed over as it is parsed, and lands once, in a reused buffer (``resp``). A cluster's routing stays
        redis-py's."""
        chunks = [[self.key_name(k) for k in c] for c in _chunks(keys, sizes, self.read_bytes)]
        if not chunks:
            return
        if self.cluster or getattr(self.reads, "connection_pool", None) is None:
            for names in chunks:
                yield from self._each(self.reads, command, names, *args)
            return
        for r in streamed(self.reads.connection_pool, [[(command.upper(), n, *args) for n in c] for c in chunks]):
            yield _per_key([r])[0]

    def payloads(self, keys: Sequence[bytes], sizes: Optional[Sequence[int]] = None) -> list:
        """Each block's bytes (as ``records``)."""
        return list(self._read_each("hget", keys, sizes, FIELD_PAYLOAD))

    def put_many(self, items: Sequence[tuple[BlockRecord, object]]) -> None:
        """Write ``(record, payload)`` blocks, and list each under its parent, in one pipeline."""
        pipe = self.writes.pipeline(transaction=False)
        for rec, payload in items:
            packed = replace(rec, offset=-1).pack()
            fields = {FIELD_PAYLOAD: payload, FIELD_RECORD: packed, FIELD_ROOT: rec.root}
            if self.signer is not None:
                fields[FIELD_TAG] = self.signer.tag(rec.key, packed, payload)
            pipe.hset(self.key_name(rec.key), mapping=fields)
            pipe.zadd(self.kids_name(rec.root, rec.parent), {_member(rec.tokens, rec.key): 0})
        pipe.execute()

    def register_model(self, root: bytes, info: dict) -> Optional[dict]:
        """Describe a model (the first host's description stays); the one already there, if any."""
        if self.writes.hsetnx(self.models_name(), root, msgpack.packb(info, use_bin_type=True)):
            return None
        raw = self.reads.hget(self.models_name(), root)
        try:
            theirs = msgpack.unpackb(raw, raw=False) if raw else None
        except Exception:
            return None
        return theirs if isinstance(theirs, dict) else None

    def _each(self, client, command: str, names: Sequence[bytes], *args) -> list:
        """One command per key, pipelined in one round trip; per-key errors (a value of another type) come back
        as exception objects."""
        pipe = client.pipeline(transaction=False)
        for name in names:
            getattr(pipe, command)(name, *args)
        return _per_key(pipe.execute(raise_on_error=False))

    # ---------------------------------------------- maintenance (kvstore CLI)

    def node_infos(self, section: str) -> list[dict]:
        """``INFO section`` of every primary (one for a single server)."""
        c = self.reads
        if self.cluster:
            return [c.get_redis_connection(node).info(section) for node in c.get_primaries()]
        return [c.info(section)]

    def scan(self, namespace: Optional[str] = "*", batch: int = 500) -> Iterator[tuple[bytes, str, bytes, int]]:
        """Every block ``(name, namespace tag, root, payload bytes)`` of one namespace (``"*"``: all), in batches."""
        ns = b"*" if namespace == "*" else namespace_tag(namespace).encode()
        names: list[bytes] = []

        def flush():
            pipe = self.reads.pipeline(transaction=False)
            for nm in names:
                pipe.hget(nm, FIELD_ROOT)
                pipe.hstrlen(nm, FIELD_PAYLOAD)
            res = pipe.execute(raise_on_error=False)
            for nm, root, size in zip(names, res[::2], res[1::2]):
                if isinstance(root, bytes) and isinstance(size, int):
                    yield nm, nm[len(PREFIX):].rsplit(b":{", 1)[0].decode(errors="replace"), root, size
            names.clear()

        for nm in self.reads.scan_iter(match=PREFIX + ns + b":{*}", count=1000, _type="hash"):
            names.append(nm)
            if len(names) >= batch:
                yield from flush()
        yield from flush()

    def models(self, namespace: Optional[str] = "*") -> dict[bytes, dict]:
        """Model descriptions by root key, from every namespace's registry."""
        ns = b"*" if namespace == "*" else namespace_tag(namespace).encode()
        out: dict[bytes, dict] = {}
        for nm in self.reads.scan_iter(match=PREFIX + ns + b":models", count=1000):
            try:
                for root, raw in self.reads.hgetall(nm).items():
                    out[root] = msgpack.unpackb(raw, raw=False)
            except Exception:
                continue  # a foreign value under our name: no names, blocks still count
        return out

    def listings(self, roots: Sequence[bytes], namespace: Optional[str] = "*") -> list[bytes]:
        """Names of the children listings of these models' blocks."""
        ns = b"*" if namespace == "*" else namespace_tag(namespace).encode()
        return [nm for root in roots
                for nm in self.reads.scan_iter(match=PREFIX + ns + b":kids:" + root.hex().encode() + b":*",
                                               count=1000, _type="zset")]

    def remove_names(self, names: Sequence[bytes]) -> int:
        """Delete keys found by ``scan``; returns how many were there."""
        names = list(names)
        return sum(n for i in range(0, len(names), 1000)
                   for n in self._each(self.writes, "unlink", names[i : i + 1000]) if isinstance(n, int))


def _per_key(replies: list) -> list:
    """Replies of a pipeline, with a value of another type under our name
    (WRONGTYPE) left in place as that key's answer; any other error (no
    permission, a cluster redirect, a server fault) is the call's failure."""
    for r in replies:
        if isinstance(r, Exception) and not str(r).startswith("WRONGTYPE"):
            raise r
    return replies


def _member(tokens: np.ndarray, key: bytes) -> bytes:
    return np.ascontiguousarray(tokens, dtype=">i8").tobytes() + key  # one width for every id (images: < 0)


def _children(replies: list) -> list[tuple[bytes, np.ndarray, bytes]]:
    out = []
    for found in replies:
        for m in found if isinstance(found, list) else []:
            if isinstance(m, bytes) and len(m) > 16 and (len(m) - 16) % 8 == 0 and all(m != c[2] for c in out):
                out.append((m[-16:], np.frombuffer(m[:-16], dtype=">i8").astype(np.int64), m))
    return out


def _chunks(keys: Sequence[bytes], sizes: Optional[Sequence[int]], limit: int) -> Iterator[Sequence[bytes]]:
    """``keys`` in runs of about ``limit`` payload bytes (one run without sizes)."""
    i = 0
    while i < len(keys):
        j, total = i, 0
        while j < len(keys) and (j == i or sizes is None or total + sizes[j] <= limit):
            total += 0 if sizes is None else sizes[j]
            j += 1
        yield keys[i:j]
        i = j


def _is_auth(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("WRONGPASS", "NOAUTH", "invalid username-password", "Authentication required",
                                   "invalid password"))
