"""Handing a few bytes from rank 0 to every rank over TCP: NCCL's unique id when the ranks
were started by torchrun (no MPI to broadcast it).

Rank 0 listens on the rendezvous address and sends the bytes to each of the other
`size - 1` ranks that connect; the others retry connecting until the timeout. torchrun's own
store already listens on MASTER_PORT, so the default address is MASTER_ADDR:MASTER_PORT+1.
"""
from __future__ import annotations

import os
import socket
import time

from ...errors import TensorParallelError
from .ranks import RankInfo

_MAGIC = b"metrale-tp1"


def default_address(env=None) -> str:
    """MASTER_ADDR:MASTER_PORT+1 from the launcher's environment."""
    env = os.environ if env is None else env
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise TensorParallelError("tensor parallel: no rendezvous address: the ranks were not "
                                  "started by an MPI launcher and MASTER_ADDR / MASTER_PORT "
                                  "are not set (torchrun sets them); pass "
                                  "tp_rendezvous='host:port' to metrale.load")
    try:
        return f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}"
    except ValueError:
        raise TensorParallelError(f"tensor parallel: MASTER_PORT={env['MASTER_PORT']!r} is "
                                  "not a port number") from None


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TensorParallelError(f"tensor parallel: rendezvous address {address!r} is not "
                                  "'host:port'")
    return host, int(port)


def share_bytes(address: str, ranks: RankInfo, payload: bytes | None, nbytes: int,
                timeout_s: float) -> bytes:
    """Rank 0's `payload` (`nbytes` long) on every rank; TensorParallelError after
    `timeout_s` when a rank never shows up."""
    host, port = parse_address(address)
    deadline = time.monotonic() + float(timeout_s)
    if ranks.rank == 0:
        if payload is None or len(payload) != nbytes:
            raise TensorParallelError("rendezvous: rank 0 must give the payload")
        _serve(host, port, ranks, payload, deadline, timeout_s)
        return payload
    return _fetch(host, port, ranks, nbytes, deadline, timeout_s)


def _serve(host, port, ranks, payload, deadline, timeout_s) -> None:
    with socket.create_server((host, port), reuse_port=False) as srv:
        served = 0
        while served < ranks.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(
                    f"tensor parallel: rank 0 of {ranks.size}: {ranks.size - 1 - served} "
                    f"rank(s) did not reach the rendezvous at {host}:{port} within "
                    f"{timeout_s:.1f} s")
            srv.settimeout(left)
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                conn.sendall(_MAGIC + payload)
            served += 1


def _fetch(host, port, ranks, nbytes, deadline, timeout_s) -> bytes:
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0) as conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                data = b""
                want = len(_MAGIC) + nbytes
                while len(data) < want:
                    chunk = conn.recv(want - len(data))
                    if not chunk:
                        break
                    data += chunk
            if len(data) == len(_MAGIC) + nbytes and data.startswith(_MAGIC):
                return data[len(_MAGIC):]
            last = f"a short or foreign answer ({len(data)} bytes)"
        except OSError as e:   # rank 0 not listening yet
            last = str(e)
        time.sleep(0.05)
    raise TensorParallelError(f"tensor parallel: rank {ranks.rank} of {ranks.size} could not "
                              f"fetch the rendezvous bytes from {host}:{port} within "
                              f"{timeout_s:.1f} s ({last})")
