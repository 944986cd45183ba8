"""A TCP relay in front of an origin server that counts the bytes the origin sends: what pods on
real nodes read from "the origin" (an S3 server of the tests), whoever reads it (KServe's
initializer, ours, an agent) and however (ranges, several connections).

It counts TCP payload from the origin to its clients, HTTP headers included, so zero means no
request at all reached the origin. The bytes are streamed (nothing is buffered whole), so a
multi-gigabyte model passes at full speed, unless a test sets ``rate`` (bytes per second from the
origin, all connections together) to keep a download under way long enough to act on it.
"""

from __future__ import annotations

import socket
import threading
import time


class CountingRelay:
    """Listens on ``host`` (a free port) and relays every connection to ``upstream``."""

    def __init__(self, host: str, upstream: tuple[str, int], rate: int = 0) -> None:
        self.upstream = upstream
        self.rate = rate
        self._lock = threading.Lock()
        self._next_free = 0.0  # when the rate limit lets the next byte go
        self._down = 0
        self._connections = 0
        self._listener = socket.create_server((host, 0))
        self.host, self.port = host, self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """host:port, as KServe's s3-endpoint annotation wants it."""
        return f"{self.host}:{self.port}"

    @property
    def bytes_from_origin(self) -> int:
        with self._lock:
            return self._down

    @property
    def connections(self) -> int:
        with self._lock:
            return self._connections

    def reset(self) -> None:
        with self._lock:
            self._down = self._connections = 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                origin = socket.create_connection(self.upstream, timeout=30)
            except OSError:
                client.close()
                continue
            origin.settimeout(None)
            with self._lock:
                self._connections += 1
                self._open |= {client, origin}
            threading.Thread(target=self._pump, args=(client, origin, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(origin, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if count:
                    self._throttle(n)
                dst.sendall(view[:n])
                if count:
                    with self._lock:
                        self._down += n
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self._lock:
                self._open -= {src, dst}

    def _throttle(self, n: int) -> None:
        with self._lock:
            rate = self.rate
            if rate <= 0:
                return
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / rate
            wait = self._next_free - now
        time.sleep(wait)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            left = list(self._open)
        for s in left:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
