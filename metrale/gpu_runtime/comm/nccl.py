"""`NcclCommunicator`: the `Communicator` protocol over NCCL, for `CudaBackend` ranks.

NCCL comes from the `nvidia-nccl-cu12` wheel (`pip install 'metrale[nccl]'`), driven through
CuPy's bindings (`cupy.cuda.nccl`). One process per GPU; every collective is enqueued on the
stream it is given (the model's stream), so it orders with the model's kernels and is
captured into the decode CUDA graphs like them (NCCL >= 2.9.6 supports stream capture).

  all_gather / broadcast / all_reduce   ncclAllGather / ncclBroadcast / ncclAllReduce (sum)
  all_to_all / all_to_all_v            ncclSend + ncclRecv to every rank in one group (a
                                        zero count is no call: NCCL matches calls, not bytes)
  barrier                               an all_reduce of one int
  exchange (host)                       an all_gather on a second communicator (split from
                                        the first) and stream of its own, through pinned host
                                        buffers: the agreement step never waits for the
                                        model's stream
  wait                                  an event on the stream, polled against the timeout

The unique id goes from rank 0 to the others by MPI when an MPI launcher started the ranks
(and mpi4py is installed), else over TCP (comm/rendezvous.py; torchrun). Creating the
communicators runs on a helper thread so that a rank that never arrives gives a timeout.
On a timeout (or an asynchronous NCCL error) both communicators are aborted
(ncclCommAbort), which releases kernels stuck waiting for a dead peer; the group is broken.

NOT RUN: this module was written and import-checked on a machine without a GPU (issue 26);
it has not been executed against NCCL on a device.
"""
from __future__ import annotations

import threading

import numpy as np

from ...errors import TensorParallelError, Unsupported
from .communicator import (EXCHANGE_BYTES, Deadline, check_collective, check_counts,
                           pack_payload, timeout_message, unpack_payloads)
from .ranks import RankInfo

UNIQUE_ID_BYTES = 128


def import_nccl():
    """CuPy's NCCL bindings, or Unsupported naming the wheel to install."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:   # pragma: no cover - CuPy is a dependency
        raise Unsupported(f"tensor parallelism on CUDA needs CuPy's NCCL bindings: {e}") from None
    if not getattr(nccl, "available", False):
        raise Unsupported("tensor parallelism on CUDA needs NCCL: pip install 'metrale[nccl]' "
                          "(the nvidia-nccl-cu12 wheel, which CuPy loads)")
    return nccl


def nccl_dtype(nccl, dt: np.dtype) -> int:
    """NCCL's type code for a collective's numpy dtype (uint16 holds BF16 bits)."""
    return {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.uint16): nccl.NCCL_BFLOAT16, np.dtype(np.uint8): nccl.NCCL_UINT8}[dt]


def share_unique_id(nccl, ranks: RankInfo, timeout_s: float, rendezvous: str | None) -> bytes:
    """NCCL's unique id, made by rank 0, on every rank."""
    uid = bytes(nccl.get_unique_id()) if ranks.rank == 0 else None
    if rendezvous is None and ranks.is_mpi:
        from .mpi_group import init_mpi
        try:
            MPI = init_mpi(ranks, timeout_s)   # bounded: a peer may never reach MPI
        except Unsupported:                   # no mpi4py: the TCP rendezvous below
            MPI = None
        if MPI is not None:
            buf = np.frombuffer(uid, np.uint8).copy() if uid else \
                np.zeros(UNIQUE_ID_BYTES, np.uint8)
            req = MPI.COMM_WORLD.Ibcast(buf, root=0)

            def fail(waited):
                raise TensorParallelError(timeout_message(ranks.rank, ranks.size,
                                                          "the NCCL id broadcast", waited))
            Deadline(timeout_s).wait(req.Test, fail)
            return buf.tobytes()
    from .rendezvous import default_address, share_bytes
    return share_bytes(rendezvous or default_address(), ranks, uid, UNIQUE_ID_BYTES, timeout_s)


class NcclCommunicator:
    """A tensor-parallel group of CUDA ranks over NCCL; see the module docstring."""

    name = "nccl"

    @classmethod
    def create(cls, backend, ranks: RankInfo, *, timeout_s: float,
               rendezvous: str | None = None) -> "NcclCommunicator":
        nccl = import_nccl()
        uid = share_unique_id(nccl, ranks, timeout_s, rendezvous)
        return cls(backend, ranks.rank, ranks.size, uid, timeout_s=timeout_s)

    def __init__(self, backend, rank: int, size: int, unique_id: bytes, *,
                 timeout_s: float) -> None:
        self._nccl = nccl = import_nccl()
        self.backend = backend
        self.rank, self.size = int(rank), int(size)
        self.timeout_s = float(timeout_s)
        self._deadline = Deadline(timeout_s)
        self._broken: str | None = None
        self._comm = self._ctl = None
        self._owned = []
        self._comm = self._bounded("ncclCommInitRank",
                                   lambda: nccl.NcclCommunicator(self.size, unique_id, self.rank))
        self._ctl = self._bounded("ncclCommSplit", lambda: self._comm.commSplit(0, self.rank))
        b = backend
        self._ctl_stream = b.create_stream()
        self._ctl_send = self._alloc(EXCHANGE_BYTES)
        self._ctl_recv = self._alloc(self.size * EXCHANGE_BYTES)
        self._one = self._alloc(4)
        b.copy_h2d(np.ones(1, np.int32), self._one)
        self._host_send = b.pinned_host(EXCHANGE_BYTES)
        self._host_recv = b.pinned_host(self.size * EXCHANGE_BYTES)
        self._event = b.create_event()
        self._ctl_event = b.create_event()

    # device collectives -----------------------------------------------------------------
    def all_gather(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None:
        dt = check_collective("all_gather", count, dtype)
        self._check()
        self._comm.allGather(int(send_ptr), int(recv_ptr), int(count),
                             nccl_dtype(self._nccl, dt), self._stream(stream))

    def all_to_all(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None:
        dt = check_collective("all_to_all", count, dtype)
        self._check()
        code, s, step = nccl_dtype(self._nccl, dt), self._stream(stream), int(count) * dt.itemsize
        self._nccl.groupStart()
        try:
            for peer in range(self.size):
                self._comm.send(int(send_ptr) + peer * step, int(count), code, peer, s)
                self._comm.recv(int(recv_ptr) + peer * step, int(count), code, peer, s)
        finally:
            self._nccl.groupEnd()

    def all_to_all_v(self, send_ptr, send_counts, recv_ptr, recv_counts, dtype,
                     stream: int) -> None:
        dt = check_collective("all_to_all_v", 1, dtype)
        sc = check_counts("all_to_all_v send", send_counts, self.size)
        rc = check_counts("all_to_all_v recv", recv_counts, self.size)
        self._check()
        code, s, item = nccl_dtype(self._nccl, dt), self._stream(stream), dt.itemsize
        self._nccl.groupStart()
        try:
            so = ro = 0
            for peer in range(self.size):
                if sc[peer]:
                    self._comm.send(int(send_ptr) + so * item, sc[peer], code, peer, s)
                if rc[peer]:
                    self._comm.recv(int(recv_ptr) + ro * item, rc[peer], code, peer, s)
                so, ro = so + sc[peer], ro + rc[peer]
        finally:
            self._nccl.groupEnd()

    def all_reduce(self, send_ptr, recv_ptr, count: int, dtype, stream: int) -> None:
        dt = check_collective("all_reduce", count, dtype, reduce=True)
        self._check()
        self._comm.allReduce(int(send_ptr), int(recv_ptr), int(count),
                             nccl_dtype(self._nccl, dt), self._nccl.NCCL_SUM,
                             self._stream(stream))

    def broadcast(self, ptr, count: int, dtype, root: int, stream: int) -> None:
        dt = check_collective("broadcast", count, dtype)
        if not 0 <= int(root) < self.size:
            raise TensorParallelError(f"broadcast: root {root} is not a rank of {self.size}")
        self._check()
        self._comm.broadcast(int(ptr), int(ptr), int(count), nccl_dtype(self._nccl, dt),
                             int(root), self._stream(stream))

    def barrier(self, stream: int) -> None:
        self.all_reduce(self._one, self._one, 1, np.int32, stream)

    # host side ----------------------------------------------------------------------------
    def exchange(self, payload: bytes) -> list[bytes]:
        self._check()
        b, s = self.backend, self._ctl_stream
        self._host_send[:] = pack_payload(payload)
        b.copy_h2d_async(self._host_send, self._ctl_send, s)
        self._ctl.allGather(int(self._ctl_send), int(self._ctl_recv), EXCHANGE_BYTES,
                            self._nccl.NCCL_UINT8, b.stream_handle(s))
        b.copy_d2h_async(self._ctl_recv, self._host_recv, s)
        self._wait_event(self._ctl_event, s, "the agreement exchange")
        return unpack_payloads(self._host_recv)

    def wait(self, stream: int) -> None:
        self._check()
        self._wait_event(self._event, stream, "waiting for the stream's collectives")

    def announce_failure(self, text: str) -> None:
        """This rank failed mid-step: abort both communicators, so the peers' waits end
        with NCCL's remote error instead of the timeout (not run on GPUs)."""
        if self._broken is None and self._comm is not None:
            try:
                self._fail(f"tensor parallel: rank {self.rank} of {self.size} failed "
                           f"mid-step: {text}", None)
            except TensorParallelError:
                pass

    def close(self) -> None:
        if self._broken is None:   # a broken group's communicators are aborted already
            for c in (self._ctl, self._comm):
                if c is not None:
                    c.destroy()
        self._ctl = self._comm = None
        for p in self._owned:
            self.backend.free(p)
        self._owned.clear()

    # internals ------------------------------------------------------------------------
    def _alloc(self, nbytes: int):
        p = self.backend.alloc(nbytes)
        self._owned.append(p)
        return p

    def _stream(self, stream: int) -> int:
        return self.backend.stream_handle(stream)

    def _wait_event(self, event: int, stream: int, what: str) -> None:
        b = self.backend
        b.record_event(event, stream)

        def done() -> bool:
            try:
                self._comm.check_async_error()
                self._ctl.check_async_error()
            except self._nccl.NcclError as e:
                self._fail(f"tensor parallel: rank {self.rank} of {self.size}: {what}: "
                           f"NCCL reported {e}", None)
            return b.event_query(event)
        self._deadline.wait(done, lambda waited: self._fail(what, waited))

    def _bounded(self, what: str, fn):
        """fn() on a helper thread (the device current there), bounded by the timeout."""
        box: dict = {}

        def run() -> None:
            try:
                self.backend.bind_to_thread()
                box["value"] = fn()
            except BaseException as e:   # handed to the caller below
                box["error"] = e
        t = threading.Thread(target=run, name=f"metrale-{what}", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self._broken = timeout_message(self.rank, self.size, what, self.timeout_s)
            raise TensorParallelError(self._broken)
        if "error" in box:
            raise TensorParallelError(f"tensor parallel: rank {self.rank} of {self.size}: "
                                      f"{what} failed: {box['error']}") from box["error"]
        return box["value"]

    def _check(self) -> None:
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        if self._comm is None:
            raise TensorParallelError("tensor parallel: the communicator was closed")

    def _fail(self, what: str, waited: float | None) -> None:
        self._broken = (what if waited is None else
                        timeout_message(self.rank, self.size, what, waited))
        for c in (self._comm, self._ctl):
            try:
                c.abort()   # releases kernels spinning on a dead peer
            except Exception:
                pass
        raise TensorParallelError(self._broken)
