"""The NCCL communicator without a GPU: its calls into CuPy's NCCL bindings checked against
the bindings' own signatures (where the nvidia-nccl-cu12 wheel is installed), run against a
recording stand-in of the bindings over host memory, its timeout and abort, and the TCP
rendezvous that hands NCCL's unique id to torchrun-started ranks. NOT a run on a GPU."""
import ctypes
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from metrale import InvalidArgument, TensorParallelError, Unsupported
from metrale.gpu_runtime import HostBackend
from metrale.gpu_runtime.comm import nccl as comm_nccl
from metrale.gpu_runtime.comm.communicator import EXCHANGE_BYTES
from metrale.gpu_runtime.comm.ranks import RankInfo
from metrale.gpu_runtime.comm.rendezvous import default_address, parse_address, share_bytes

# The bindings' signatures as comm/nccl.py calls them (cupy_backends/cuda/libs/nccl.pyx).
SIGNATURES = {
    "allGather": ["sendbuf", "recvbuf", "count", "datatype", "stream"],
    "allReduce": ["sendbuf", "recvbuf", "count", "datatype", "op", "stream"],
    "broadcast": ["sendbuff", "recvbuff", "count", "datatype", "root", "stream"],
    "send": ["sendbuf", "count", "datatype", "peer", "stream"],
    "recv": ["recvbuf", "count", "datatype", "peer", "stream"],
    "commSplit": ["color", "key", "config"],
    "abort": [], "destroy": [], "check_async_error": [],
}


def test_the_bindings_have_the_signatures_we_call():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        pytest.skip(f"CuPy's NCCL bindings: {e}")
    if not nccl.available:
        pytest.skip("the nvidia-nccl-cu12 wheel is not installed (pip install 'metrale[nccl]')")
    for name, params in SIGNATURES.items():
        doc = getattr(nccl.NcclCommunicator, name).__doc__.splitlines()[0]
        got = re.findall(r"(\w+)(?:=[^,)]*)?(?=[,)])", doc.split("(", 1)[1])
        assert got[1:] == params, (name, doc)   # got[0] is self
    assert "ndev" in nccl.NcclCommunicator.__doc__ and "commId" in nccl.NcclCommunicator.__doc__
    assert len(nccl.get_unique_id()) == comm_nccl.UNIQUE_ID_BYTES
    assert {comm_nccl.nccl_dtype(nccl, np.dtype(d)) for d in
            (np.float32, np.int32, np.uint16, np.uint8)} == \
        {nccl.NCCL_FLOAT32, nccl.NCCL_INT32, nccl.NCCL_BFLOAT16, nccl.NCCL_UINT8}


class FakeNccl:
    """A recording stand-in for `cupy.cuda.nccl` with the bindings' parameter order; for a
    group of one it moves the bytes (host memory), so the communicator really runs."""

    NCCL_FLOAT32, NCCL_INT32, NCCL_BFLOAT16, NCCL_UINT8, NCCL_SUM = 7, 2, 9, 1, 0
    available = True
    SIZES = {7: 4, 2: 4, 9: 2, 1: 1}

    class NcclError(Exception):
        pass

    def __init__(self) -> None:
        self.calls = []
        fake = self

        class Comm:
            def __init__(self, ndev, commId, rank, config=None):
                fake.calls.append(("init", ndev, len(commId), rank))
                self.ndev = ndev

            def _copy(self, dst, src, count, datatype):
                ctypes.memmove(dst, src, count * fake.SIZES[datatype])

            def allGather(self, sendbuf, recvbuf, count, datatype, stream):
                fake.calls.append(("allGather", count, datatype, stream))
                self._copy(recvbuf, sendbuf, count, datatype)

            def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
                fake.calls.append(("allReduce", count, datatype, op, stream))
                self._copy(recvbuf, sendbuf, count, datatype)

            def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
                fake.calls.append(("broadcast", count, datatype, root, stream))

            def send(self, sendbuf, count, datatype, peer, stream):
                fake.calls.append(("send", count, datatype, peer, stream))
                fake._pending = (sendbuf, count, datatype)

            def recv(self, recvbuf, count, datatype, peer, stream):
                fake.calls.append(("recv", count, datatype, peer, stream))
                self._copy(recvbuf, fake._pending[0], count, datatype)

            def commSplit(self, color, key, config=None):
                fake.calls.append(("commSplit", color, key))
                return Comm(self.ndev, b"x" * 128, key)

            def abort(self):
                fake.calls.append(("abort",))

            def destroy(self):
                fake.calls.append(("destroy",))

            def check_async_error(self):
                return None
        self.NcclCommunicator = Comm

    def groupStart(self):
        self.calls.append(("groupStart",))

    def groupEnd(self):
        self.calls.append(("groupEnd",))

    def get_unique_id(self):
        return b"u" * 128


class FakeCuda(HostBackend):
    """HostBackend memory dressed as a CudaBackend (stream handles, pinned buffers)."""

    name = "cuda:0"

    def __init__(self, done=True) -> None:
        super().__init__()
        self.done = done

    def stream_handle(self, stream):
        return 1000 + int(stream)

    def pinned_host(self, nbytes):
        return np.zeros(int(nbytes), np.uint8)

    def bind_to_thread(self):
        pass

    def event_query(self, event):
        return self.done


@pytest.fixture
def fake(monkeypatch):
    f = FakeNccl()
    monkeypatch.setattr(comm_nccl, "import_nccl", lambda: f)
    return f


def test_a_group_of_one_runs_every_collective(fake):
    be = FakeCuda()
    c = comm_nccl.NcclCommunicator(be, 0, 1, b"u" * 128, timeout_s=5)
    assert fake.calls[:2] == [("init", 1, 128, 0), ("commSplit", 0, 0)]
    src = be.alloc(16)
    be.copy_h2d(np.arange(4, dtype=np.float32), src)
    dst = be.alloc(16)
    c.all_gather(src, dst, 4, np.float32, 0)
    out = np.empty(4, np.float32)
    be.copy_d2h(dst, out)
    assert out.tolist() == [0, 1, 2, 3]
    assert fake.calls[-1] == ("allGather", 4, 7, 1000)
    c.all_to_all(src, dst, 2, np.uint16, 5)
    assert fake.calls[-4:] == [("groupStart",), ("send", 2, 9, 0, 1005), ("recv", 2, 9, 0, 1005),
                               ("groupEnd",)]
    c.all_reduce(src, dst, 4, np.int32, 0)
    assert fake.calls[-1] == ("allReduce", 4, 2, 0, 1000)
    c.broadcast(src, 3, np.uint8, 0, 0)
    assert fake.calls[-1] == ("broadcast", 3, 1, 0, 1000)
    c.barrier(0)
    assert fake.calls[-1][:2] == ("allReduce", 1)
    assert c.exchange(b"hello") == [b"hello"]
    assert fake.calls[-1] == ("allGather", EXCHANGE_BYTES, 1, 1000 + c._ctl_stream)
    c.wait(0)
    c.close()
    assert fake.calls[-2:] == [("destroy",), ("destroy",)]
    be.free(src)
    be.free(dst)
    assert be.live_bytes() == 0


def test_a_silent_peer_times_out_and_aborts(fake):
    be = FakeCuda(done=False)
    c = comm_nccl.NcclCommunicator(be, 0, 2, b"u" * 128, timeout_s=0.2)
    with pytest.raises(TensorParallelError, match="rank 0 of 2: waiting for the stream"):
        c.wait(0)
    assert fake.calls[-2:] == [("abort",), ("abort",)]
    with pytest.raises(TensorParallelError, match="got no answer"):
        c.all_gather(1, 2, 3, np.float32, 0)   # broken: refused before any call
    c.close()


def test_a_rank_that_never_arrives_at_init_times_out(fake, monkeypatch):
    import threading
    never = threading.Event()
    fake.NcclCommunicator = lambda *a, **k: never.wait(5)
    with pytest.raises(TensorParallelError, match="ncclCommInitRank got no answer"):
        comm_nccl.NcclCommunicator(FakeCuda(), 1, 2, b"u" * 128, timeout_s=0.2)
    never.set()


def test_nccl_missing_is_named(monkeypatch):
    import cupy.cuda
    monkeypatch.setattr(cupy.cuda, "nccl", type("M", (), {"available": False})(),
                        raising=False)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", cupy.cuda.nccl)
    with pytest.raises(Unsupported, match=r"metrale\[nccl\]"):
        comm_nccl.import_nccl()


def test_unique_id_over_tcp(fake, tmp_path):
    """Rank 0 (this process) hands the id to rank 1 (a child process) over the rendezvous."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = textwrap.dedent(f"""
        from metrale.gpu_runtime.comm.ranks import RankInfo
        from metrale.gpu_runtime.comm.rendezvous import share_bytes
        print(share_bytes("127.0.0.1:{port}", RankInfo(1, 2, 1, "torchrun"), None, 128, 20).hex())
    """)
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    uid = comm_nccl.share_unique_id(fake, RankInfo(0, 2, 0, "torchrun"), 20,
                                    f"127.0.0.1:{port}")
    out, _ = p.communicate(timeout=30)
    assert uid == b"u" * 128 and bytes.fromhex(out.strip()) == uid


def test_rendezvous_timeouts_and_addresses():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TensorParallelError, match="did not reach the rendezvous"):
        share_bytes(f"127.0.0.1:{port}", RankInfo(0, 2, 0, "torchrun"), b"x" * 4, 4, 0.3)
    with pytest.raises(TensorParallelError, match="could not fetch"):
        share_bytes(f"127.0.0.1:{port}", RankInfo(1, 2, 0, "torchrun"), None, 4, 0.3)
    assert parse_address("10.0.0.1:29501") == ("10.0.0.1", 29501)
    with pytest.raises(TensorParallelError, match="not 'host:port'"):
        parse_address("10.0.0.1")
    assert default_address({"MASTER_ADDR": "h", "MASTER_PORT": "29500"}) == "h:29501"
    with pytest.raises(TensorParallelError, match="tp_rendezvous"):
        default_address({})


def test_all_to_all_v_is_one_group_of_sends_and_receives(fake):
    """Rank 1 of 3: a send and a receive per peer with a nonzero count, at the segments'
    byte offsets, in one group (NCCL matches calls: a zero count is no call on either side)."""
    be = FakeCuda()
    c = comm_nccl.NcclCommunicator(be, 1, 3, b"u" * 128, timeout_s=5)
    calls = []
    c._comm.send = lambda buf, n, dt, peer, s: calls.append(("send", buf, n, dt, peer, s))
    c._comm.recv = lambda buf, n, dt, peer, s: calls.append(("recv", buf, n, dt, peer, s))
    src, dst = be.alloc(64), be.alloc(64)
    fake.calls.clear()
    c.all_to_all_v(src, [2, 0, 3], dst, [1, 4, 0], np.float32, 2)
    s, r = int(src), int(dst)
    assert calls == [("send", s, 2, 7, 0, 1002), ("recv", r, 1, 7, 0, 1002),
                     ("recv", r + 4, 4, 7, 1, 1002), ("send", s + 8, 3, 7, 2, 1002)]
    assert fake.calls == [("groupStart",), ("groupEnd",)]
    with pytest.raises(InvalidArgument, match="3 ints"):
        c.all_to_all_v(src, [1, 2], dst, [1, 1, 1], np.float32, 0)
    with pytest.raises(InvalidArgument, match=">= 0"):
        c.all_to_all_v(src, [1, -1, 0], dst, [1, 1, 1], np.float32, 0)
    c.close()
    be.free(src)
    be.free(dst)


def test_a_failure_mid_step_aborts_both_communicators(fake):
    """announce_failure (a rank failed after the agreement): both communicators aborted, so
    the peers' waits end with NCCL's remote error; every later call names the failure."""
    be = FakeCuda()
    c = comm_nccl.NcclCommunicator(be, 1, 2, b"u" * 128, timeout_s=5)
    fake.calls.clear()
    c.announce_failure("RuntimeError: boom")
    assert fake.calls == [("abort",), ("abort",)]
    with pytest.raises(TensorParallelError, match="rank 1 of 2 failed mid-step: RuntimeError: "
                                                  "boom"):
        c.all_gather(0, 0, 1, np.float32, 0)
    c.announce_failure("again")   # once
    assert fake.calls == [("abort",), ("abort",)]
    c.close()
