"""The replies of a pipelined block read, parsed off the socket here.

redis-py's parser (hiredis) makes a ``bytes`` of each value: fresh memory,
page-faulted in as it is filled, then copied into. Here a large value is
read by the kernel straight into a buffer from ``kvstore.buffers`` -- one
the RAM tier let go of, already in memory (on CUDA, page-locked, so a hit
uploads it on the copy engine with no staging; where none is free, a
pageable one: making page-locked memory would stall the GPU mid-request)
-- which then holds the block. Only what ``RemoteTier`` reads comes through here: RESP2 replies to
HGET/HMGET in RESP2 or RESP3 (bulk strings, nulls, arrays, errors;
integers and simple strings for completeness). The connection is redis-py's (connected,
authenticated, TLS); a reply that cannot be parsed leaves it disconnected.
"""

from __future__ import annotations

from typing import Any

from .. import buffers

_SMALL = 1 << 16  # values up to this size are sliced out of the read buffer


def pipelined(pool, commands: list[tuple]) -> list[Any]:
    """The replies to ``commands``, sent in one round trip on a connection
    of redis-py's ``pool``."""
    import redis

    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py before 5.3 requires the command's name
        conn = pool.get_connection(commands[0][0])
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise ConnectionError("redis-py's connection has no socket attribute: an unsupported version")
        return Replies(sock, redis.ResponseError).read(len(commands))
    except BaseException:
        conn.disconnect()  # a reply cut or unparsed: its rest must not be read as the next one
        raise
    finally:
        pool.release(conn)


class ProtocolError(Exception):
    """The server's bytes are not a reply this module reads."""


class Replies:
    def __init__(self, sock, error: type[Exception]):
        self.sock = sock
        self.error = error  # the client library's ResponseError: per-key errors look as redis-py's do
        self.buf = bytearray(_SMALL * 4)
        self.lo = self.hi = 0

    def read(self, n: int) -> list[Any]:
        """The next ``n`` replies."""
        out = [self._reply() for _ in range(n)]
        if self.lo != self.hi:
            raise ProtocolError(f"{self.hi - self.lo} bytes after the last reply")
        return out

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
