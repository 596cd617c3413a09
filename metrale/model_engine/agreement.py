"""The agreement step of a tensor-parallel rank: before a call launches anything that talks
to the other ranks, every rank learns how every other rank's call went so far.

In an SPMD program every rank makes the same calls, so a bad argument or a full KV pool
fails the same way on each. The agreement makes that a guarantee rather than a hope: once per
public call (the outermost `@exclusive` method), every rank hands the others a small record
(`Communicator.exchange`):
  ok      a digest of the call (its name, token ids, the lengths of its sequences, the pool's
          free and cached blocks) and a one-line summary of it;
  error   the class and message of the exception it raised before its first collective.
The record goes out at the call's first collective (`TensorParallel.before_collective`), when
the pool is asked for room (`_check_room`, before any block changes hands), or when the call
ends: whichever comes first. Then:
  - a rank failed: every rank raises the lowest failing rank's error, with its class and
    message (the failing rank re-raises its own exception object); no rank has launched
    anything, and each undoes what it changed (as after CacheFull on one device);
  - the digests differ: the ranks made different calls (or their pools drifted apart, e.g. a
    free_sequence made on one rank only): TensorParallelError on every rank, naming each
    rank's call;
  - a rank does not answer within the group's timeout: TensorParallelError (gpu_runtime/comm/communicator.py);
  - a rank fails after the agreement (mid-step: an exception in a collective or between
    two): it announces the failure (gpu_runtime/comm/notice.py), the others raise
    TensorParallelError naming it from the collective they wait in, and the job ends.
Cost: one exchange of EXCHANGE_BYTES per rank per call (an MPI all-gather of 1 KiB: ~10-20 us
on one host; NCCL: a small all-gather on its own stream plus a host wait).
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np

from .. import errors
from ..errors import ConcurrentUse, TensorParallelError
from .guard import CallGuard
from .sequence import SequenceState

_OK, _ERROR = 0, 1
_TEXT_BYTES = 900


class AgreedGuard(CallGuard):
    """The call guard of a tensor-parallel rank: one thread at a time, as `CallGuard`, plus
    one agreement per outermost call."""

    def __init__(self, comm, model) -> None:
        super().__init__()
        self.comm = comm
        self._model = model
        self._depth = 0
        self._pending: tuple[bytes, str] | None = None   # (digest, summary) not yet agreed

    def call(self, name: str, args: dict) -> "_AgreedCall":
        return _AgreedCall(self, name, args)

    def agree_now(self) -> None:
        """The agreement of the call in flight, if it has not happened yet (a no-op outside
        a call and after it). Raises the error every rank then raises."""
        if self._pending is None:
            return
        digest, summary = self._pending
        self._pending = None
        settle(self.comm, ok_record(digest, summary), None)

    # one call ----------------------------------------------------------------------------
    def _begin(self, name: str, args: dict) -> None:
        if self._depth == 0:
            self._pending = call_digest(name, args, self._model)
        self._depth += 1

    def _end(self, exc: BaseException | None) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._pending is None:   # agreed: the call failed mid-step, peers may be waiting
            if exc is not None and not is_agreed(exc) and \
                    not isinstance(exc, (TensorParallelError, ConcurrentUse)):
                announce = getattr(self.comm, "announce_failure", None)
                if announce is not None:
                    announce(f"{type(exc).__name__}: {exc}")
            return
        digest, summary = self._pending
        self._pending = None
        if exc is None:
            settle(self.comm, ok_record(digest, summary), None)
        elif not is_agreed(exc):
            settle(self.comm, error_record(exc), exc)


class _AgreedCall:
    def __init__(self, guard: AgreedGuard, name: str, args: dict) -> None:
        self.guard, self.name, self.args = guard, name, args

    def __enter__(self):
        self.guard.__enter__()        # ConcurrentUse: this call never started, no agreement
        try:
            self.guard._begin(self.name, self.args)
        except BaseException:
            self.guard.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, et, exc, tb) -> bool:
        try:
            self.guard._end(exc)      # raises a peer's error in place of this call's outcome
        finally:
            self.guard.__exit__(et, exc, tb)
        return False


def settle(comm, record: bytes, own: BaseException | None,
           mismatch: str = "made different calls or their KV pools differ",
           name_rank: bool = False) -> list[bytes]:
    """Exchange `record`; raise what every rank raises, or return every rank's record when
    all are fine and alike. `own`: this rank's exception (the caller re-raises it when it is
    the first failing rank's). `name_rank` (loading, where the ranks' errors name their own
    files): the other ranks' message starts "tensor parallel: rank R of N failed: ", and a
    rank that failed with the same error re-raises its own. An error raised here is marked
    `tp_agreed`: every rank raises it at the same point, so nothing more is exchanged for it."""
    if isinstance(own, ConcurrentUse):
        return []   # another thread's call is in flight here; its own agreement speaks for it
    records = comm.exchange(record)
    failed = [(r, rec) for r, rec in enumerate(records) if rec[:1] == bytes([_ERROR])]
    if failed:
        rank, rec = failed[0]
        if own is not None and (rank == comm.rank or
                                (name_rank and rec[17:] == error_record(own)[17:])):
            return records   # the caller re-raises its own exception
        cls_name, _, message = rec[17:].decode(errors="replace").partition("\n")
        raise _agreed(_rebuild(cls_name, message, rank,
                               len(records) if name_rank else None)) from own
    if len({rec[1:17] for rec in records}) > 1:
        calls = "; ".join(f"rank {r}: {rec[17:].decode(errors='replace')}"
                          for r, rec in enumerate(records))
        raise _agreed(TensorParallelError(f"tensor parallel: the ranks {mismatch} ({calls}); "
                                          "every rank must make the same calls with the same "
                                          "arguments")) from own
    return records


def ok_record(digest: bytes, summary: str) -> bytes:
    """An agreement record: this rank is fine; `digest` (16 bytes) must match everyone's."""
    return _record(_OK, digest, summary.encode())


def error_record(exc: BaseException) -> bytes:
    """An agreement record: this rank raised `exc` (its class and message go to the others)."""
    return _record(_ERROR, bytes(16), f"{type(exc).__name__}\n{exc}".encode())


def is_agreed(exc: BaseException) -> bool:
    """Whether `exc` came out of an agreement (every rank raises it; nothing to send)."""
    return getattr(exc, "tp_agreed", False)


def _agreed(exc: BaseException) -> BaseException:
    exc.tp_agreed = True
    return exc


def call_digest(name: str, args: dict, model) -> tuple[bytes, str]:
    """(16-byte digest, summary) of a call `name(**args)`: its name, its int arguments
    (token ids, counts, rows) and the ints inside its list / tuple / int32 / int64 array
    arguments, its sequences' lengths and the pool's state. Arguments named `*stream*` or
    `*ptr*` are left out: stream handles and pointers differ between ranks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(name.encode())
    n_seqs = n_ints = 0

    def ints(values) -> None:   # a list of ints and an int array of them hash alike
        nonlocal n_ints
        arr = np.ascontiguousarray(values, np.int64).reshape(-1)
        h.update(struct.pack("<cq", b"L", arr.size) + arr.tobytes())
        n_ints += arr.size

    def feed(x) -> None:
        nonlocal n_seqs
        if isinstance(x, SequenceState):
            h.update(struct.pack("<cqq", b"s", x.seq_len, len(x.block_table)))
            n_seqs += 1
        elif isinstance(x, np.ndarray) and x.dtype in (np.int32, np.int64):
            # token ids; uint8 / uint16 / float arrays are output buffers (copy_logits_to_host)
            ints(x)
        elif isinstance(x, (list, tuple)):
            if all(isinstance(y, (int, np.integer)) and not isinstance(y, (bool, np.bool_))
                   for y in x):
                ints(x)
                return
            h.update(struct.pack("<cq", b"l", len(x)))
            for y in x:
                feed(y)
        elif isinstance(x, (bool, np.bool_)):
            h.update(b"b1" if x else b"b0")
        elif isinstance(x, (int, np.integer)):
            ints([x])
        else:
            h.update(type(x).__name__.encode())
    for key, value in args.items():
        if "stream" in key or "ptr" in key:
            continue
        h.update(key.encode())
        feed(value)
    pool = model._pool
    h.update(struct.pack("<qq", pool.num_free(), pool.num_cached()))
    summary = (f"{name}({n_seqs} sequence(s), {n_ints} id(s); pool {pool.num_free()} free, "
               f"{pool.num_cached()} cached)")
    return h.digest(), summary


def _record(status: int, digest: bytes, text: bytes) -> bytes:
    return bytes([status]) + digest + text[:_TEXT_BYTES]


def _rebuild(cls_name: str, message: str, rank: int, size: int | None = None) -> BaseException:
    """The error rank `rank` raised, as this rank raises it: the same metrale class and
    message; other exceptions become TensorParallelError naming them. `size` given: the
    message starts "tensor parallel: rank R of N failed: "."""
    cls = getattr(errors, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.MetraleError)):
        cls, message = TensorParallelError, f"{cls_name}: {message}"
        if size is None:
            return cls(f"tensor parallel: rank {rank} raised {message}")
    return cls(message if size is None else
               f"tensor parallel: rank {rank} of {size} failed: {message}")
