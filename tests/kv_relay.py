"""A man in the middle for KV transfers (:mod:`kilat.kv_connector.tcp_wire`), to damage or slow one pull."""

from __future__ import annotations

import socket
import threading
import time

from kilat.kv_connector.tcp_wire import recv_frame, send_frame


class Relay:
    """A man in the middle between a consumer and a producer: forwards the consumer's request, then the
    producer's answer, damaged (``corrupt``: one payload byte of block 2 flipped; ``truncate``: cut inside block
    3; ``slow``: ``seconds_per_kib`` per KiB, 50 ms by default, so that a pull takes seconds)."""

    def __init__(self, producer_port: int, mode: str, bytes_per_block: int, seconds_per_kib: float = 0.05):
        self.mode, self.bytes_per_block, self.upstream = mode, bytes_per_block, producer_port
        self.seconds_per_kib = seconds_per_kib
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.started = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.server.accept()
        self.started.set()
        with conn, socket.create_connection(("127.0.0.1", self.upstream)) as up:
            send_frame(up, recv_frame(conn))
            header = recv_frame(up)
            send_frame(conn, header)
            record = self.bytes_per_block + 4
            sent = 0
            try:
                while chunk := up.recv(1024 if self.mode == "slow" else 65536):
                    data = bytearray(chunk)
                    flip = 2 * record + 10 - sent
                    if self.mode == "corrupt" and 0 <= flip < len(data):
                        data[flip] ^= 0xFF
                    if self.mode == "truncate" and sent + len(data) > 3 * record + 100:
                        conn.sendall(data[:3 * record + 100 - sent])
                        return
                    if self.mode == "slow":
                        time.sleep(self.seconds_per_kib)
                    conn.sendall(data)
                    sent += len(data)
            except OSError:
                return
