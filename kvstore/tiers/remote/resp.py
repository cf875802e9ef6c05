"""The replies of a pipelined block read, parsed off the socket here and
handed over one by one as they come in.

redis-py's parser (hiredis) makes a ``bytes`` of each value: fresh memory,
page-faulted in as it is filled, then copied into. Here a large value is
read by the kernel straight into a buffer from ``kvstore.gpu.buffers`` -- one
the RAM tier let go of, already in memory (on CUDA, page-locked, so a hit
uploads it on the copy engine with no staging; where none is free, a
pageable one: making page-locked memory would stall the GPU mid-request)
-- which then holds the block. Only what ``RemoteTier`` reads comes through here: RESP2 replies to
HGET/HMGET in RESP2 or RESP3 (bulk strings, nulls, arrays, errors;
integers and simple strings for completeness). The connection is redis-py's (connected,
authenticated, TLS); a reply that cannot be parsed leaves it disconnected.

A read streams: a thread reads ahead of the caller (``ahead``) and hands
over each reply as soon as it is parsed (``streamed``), with the next round
trip already queued on the server, so a remote hit checks and places one
block while the next is on the wire and the server is never idle between
round trips.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generator, Iterator, Sequence

from ...gpu import buffers

_SMALL = 1 << 16  # values up to this size are sliced out of the read buffer


def streamed(pool, groups: Sequence[list[tuple]]) -> Iterator[Any]:
    """The replies to ``groups`` of commands, on one connection of redis-py's
    ``pool``, each handed over as soon as it is parsed (the caller works on
    one while the next is on the wire). A group is sent once the replies of
    the one before start to arrive: the server then has it queued when it is
    done with those (never idle between round trips) and holds at most two
    groups' replies; sent at once, the first reply would wait for the second
    group's to be made. Closed before the last reply, the connection is
    dropped: the rest must not be read as the next call's."""
    import redis

    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py before 5.3 requires the command's name
        conn = pool.get_connection(groups[0][0][0])
    try:
        conn.send_packed_command(conn.pack_commands(groups[0]))
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise ConnectionError("redis-py's connection has no socket attribute: an unsupported version")
        replies = Replies(sock, redis.ResponseError)
        for i, group in enumerate(groups):
            if i + 1 < len(groups):
                replies.wait()
                conn.send_packed_command(conn.pack_commands(groups[i + 1]))
            for _ in group:
                yield replies.next()
        replies.end()
    except BaseException:
        conn.disconnect()  # a reply cut, unparsed or left unread: its rest must not be read as the next one
        raise
    finally:
        pool.release(conn)


_END = object()


def ahead(pool: ThreadPoolExecutor, items: Generator) -> Iterator:
    """``items``, made on ``pool``'s thread and each handed over as soon as
    it is ready: the caller works on one while the next is read. A caller
    that stops early stops the thread at its next item (a read left
    unfinished drops its connection: ``streamed``)."""
    got: "queue.SimpleQueue" = queue.SimpleQueue()
    stop = threading.Event()

    def make() -> None:
        try:
            for item in items:
                if stop.is_set():
                    break
                got.put((True, item))
            got.put((True, _END))
        except BaseException as e:  # raised in the caller's thread
            got.put((False, e))
        finally:
            items.close()

    pool.submit(make)
    try:
        while True:
            ok, item = got.get()
            if not ok:
                raise item
            if item is _END:
                return
            yield item
    finally:
        stop.set()


class ProtocolError(Exception):
    """The server's bytes are not a reply this module reads."""


class Replies:
    def __init__(self, sock, error: type[Exception]):
        self.sock = sock
        self.error = error  # the client library's ResponseError: per-key errors look as redis-py's do
        self.buf = bytearray(_SMALL * 4)
        self.lo = self.hi = 0

    def wait(self) -> None:
        """Until some bytes of the next reply are here."""
        if self.lo == self.hi:
            self._more()

    def next(self) -> Any:
        return self._reply()

    def end(self) -> None:
        """Raise if the server sent more than was asked for."""
        if self.lo != self.hi:
            raise ProtocolError(f"{self.hi - self.lo} bytes after the last reply")

    def _reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._bulk(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        if kind == b"_":  # RESP3's null (a connection that said HELLO 3)
            return None
        if kind == b"-":
            return self.error(rest.decode("utf-8", "replace"))
        if kind == b"!":  # RESP3's bulk error
            return self.error(bytes(self._bulk(int(rest))).decode("utf-8", "replace"))
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.lo, self.hi)
            if end >= 0:
                line = bytes(self.buf[self.lo : end])
                self.lo = end + 2
                return line
            self._more()

    def _bulk(self, n: int):
        if n <= _SMALL:
            while self.hi - self.lo < n:
                self._more()
            out: Any = bytes(self.buf[self.lo : self.lo + n])
            self.lo += n
        else:
            view = memoryview(buffers.take(n, new_pinned=False))[:n]  # (read while the engine may be running)
            have = min(n, self.hi - self.lo)
            view[:have] = self.buf[self.lo : self.lo + have]
            self.lo += have
            got = have
            while got < n:
                k = self.sock.recv_into(view[got:], n - got)
                if not k:
                    raise ConnectionError("the server closed the connection mid-reply")
                got += k
            out = view
        while self.hi - self.lo < 2:
            self._more()
        if self.buf[self.lo : self.lo + 2] != b"\r\n":
            raise ProtocolError("a bulk string without its CRLF")
        self.lo += 2
        return out

    def _more(self) -> None:
        if self.lo:
            del self.buf[: self.lo]
            self.buf.extend(bytes(self.lo))
            self.hi -= self.lo
            self.lo = 0
        if self.hi == len(self.buf):
            self.buf.extend(bytes(len(self.buf)))
        k = self.sock.recv_into(memoryview(self.buf)[self.hi :], len(self.buf) - self.hi)
        if not k:
            raise ConnectionError("the server closed the connection mid-reply")
        self.hi += k
