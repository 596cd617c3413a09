"""`TensorParallelModel`: one rank of a decoder model split over N devices, SPMD.

`metrale.load(path, device=..., tensor_parallel_size=N)` in each of N processes (started by
mpiexec, torchrun or srun; gpu_runtime/comm/ranks.py) returns this rank's model. It is a
`TransformerModel` with the pointer API unchanged: every rank makes the same calls with the
same arguments and gets the same whole logits rows, so a scheduler written for one device
runs unchanged on every rank. What differs, behind it:
  - weights: the rank's Megatron slices (tp/shard.py, tp/sharded_weights.py); its KV pool holds
    only its KV heads, its workspace only its heads and intermediate slice;
  - the layer passes end with the fixed-order combines of tp/runtime.py (hooks in layers.py);
  - every public call first agrees with the other ranks (agreement.py): an error on one
    rank is raised on every rank, different calls are an error, a silent peer a timeout;
  - the host waits for the device through the communicator, bounded by its timeout (a dead
    peer ends a wait with TensorParallelError instead of a hang).
Loading agrees too: every rank must load the same checkpoint with the same options, an error
on one rank (a missing file, no memory) is raised on all, and the KV pool gets the smallest
block count any rank can hold.
"""
from __future__ import annotations

import hashlib
import json

from ...errors import InvalidArgument, TensorParallelError, Unsupported
from ...gpu_runtime import backend_for
from ...gpu_runtime.comm.communicator import DEFAULT_TIMEOUT_S
from ...formats import open_source
from ...gpu_runtime.comm import join_group, open_communicator
from ...gpu_runtime.comm.interrupts import AbortOnInterrupt
from ...gpu_runtime.comm.ranks import RankInfo, launch_hint, launcher_ranks
from ..agreement import AgreedGuard, error_record, is_agreed, ok_record, settle
from ..memory_plan import MemoryPlan
from .ep_contract import SpmdEp
from .shard import ShardPlan, plan_shards, rank_weight_bytes
from .sharded_weights import ShardedDecoderWeights
from .runtime import TensorParallel
from ..transformer import TransformerModel

class TensorParallelModel(SpmdEp, TransformerModel):
    """One rank of a tensor-parallel decoder model; see the module docstring."""

    def __init__(self, backend, source, *, comm, plan: ShardPlan, group=None,
                 interrupts: AbortOnInterrupt | None = None, **options) -> None:
        self._comm = comm
        self._shard_plan = plan
        # closed / released at teardown: the launch's group (MPI) and SIGINT's job abort
        self._group, self._interrupts = group, interrupts
        if plan.expert_parallel:   # the dispatch reads each layer's routing on the host
            if options.get("graphs"):
                raise Unsupported(f"{source.description}: expert_parallel=True decodes without "
                                  "graphs (each MoE layer reads its routing back to size the "
                                  "all-to-all); leave graphs unset or False")
            options["graphs"] = False
        super().__init__(backend, source, _shard=_RankShard(self, comm, plan), **options)
        self._guard = AgreedGuard(comm, self)

    # the agreement comes before the pool changes (every check of a step is made by then)
    def _check_room(self, items):
        plans = super()._check_room(items)
        self._guard.agree_now()
        return plans

    # host waits bounded by the group's timeout ---------------------------------------------
    def synchronize(self, stream: int) -> None:
        self._comm.wait(self._stream_of(stream))
        super().synchronize(stream)

    def _read_ids(self, k: int, stream: int) -> list[int]:
        self._comm.wait(stream)
        return super()._read_ids(k, stream)

    def copy_logits_to_host(self, logits_ptr, dst) -> None:
        self._comm.wait(self.default_stream())
        return super().copy_logits_to_host(logits_ptr, dst)

    # facts ----------------------------------------------------------------------------------
    def tensor_parallel_rank(self) -> int:
        """This process's rank in the group (additive: not in the original engine)."""
        return self._shard_plan.rank

    def tensor_parallel_size(self) -> int:
        """Ranks in the group (additive)."""
        return self._shard_plan.size

    def weight_bytes(self) -> int:
        """Device bytes of this rank's weights (about 1/N of the whole model's)."""
        return self._weights.nbytes

    def teardown(self) -> None:
        """Free every device byte of this rank and close its communicator. Every rank
        tears down together (closing a communicator is collective for NCCL)."""
        super().teardown()
        for part in (self._comm, self._group):
            if part is not None:
                part.close()
        if self._interrupts is not None:
            self._interrupts.release()


class _RankShard:
    """What `TransformerModel.__init__` asks of a rank (its `_shard` argument)."""

    def __init__(self, model, comm, plan: ShardPlan) -> None:
        self.model, self.comm, self.plan = model, comm, plan

    def layer_metadata(self, meta):
        return self.plan.layer_metadata(meta)

    def weight_bytes(self, meta, source) -> int:
        from ...formats import expected_tensors
        tied = "lm_head.weight" not in expected_tensors(meta, source.tensor_names())
        return rank_weight_bytes(meta, self.plan, tied)

    def buffer_bytes(self, meta, *, max_tokens: int, logits_rows: int,
                     fp32_logits: bool) -> int:
        return TensorParallel.buffer_bytes(self.plan, meta, max_tokens=max_tokens,
                                           logits_rows=logits_rows, fp32_logits=fp32_logits)

    def agree_plan(self, plan: MemoryPlan, block_size: int) -> MemoryPlan:
        """The pool every rank can hold: the smallest block count and context of any rank
        (pools must match block for block, the sequences' block tables are shared)."""
        text = f"{plan.num_blocks} {plan.max_seq_len}".encode()
        records = agree_values(self.comm, text)
        blocks = min(int(r.split()[0]) for r in records)
        seq = min(int(r.split()[1]) for r in records)
        return MemoryPlan(num_blocks=blocks, max_seq_len=seq,
                          max_blocks_per_seq=-(-seq // block_size),
                          weight_bytes=plan.weight_bytes, total_bytes=plan.total_bytes)

    def upload_weights(self, backend, source, meta, progress: bool):
        return ShardedDecoderWeights(backend, source, meta, self.plan, progress=progress)

    def runtime(self, backend, meta, ws, fp32_logits: bool) -> TensorParallel:
        return TensorParallel(backend, self.comm, self.plan, meta, max_tokens=ws.max_tokens,
                              logits_rows=ws.logits_rows, fp32_logits=fp32_logits,
                              before_collective=lambda: self.model._guard.agree_now())


def agree_values(comm, value: bytes) -> list[bytes]:
    """Every rank's `value`, or the error a failing rank sent instead (raised)."""
    return [r[17:] for r in settle(comm, ok_record(bytes(16), value.decode()), None)]


# What the shard plan knows how to split: dense decoders with BF16 (or float) weights.
TP_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")

def refuse_unsharded(source, n: int, expert_parallel: bool = False) -> None:
    """Unsupported, by name, for a checkpoint tensor parallelism does not split: another
    architecture (whisper, llava, gpt-oss, ...) or a quantized linear (dense or an expert's)
    whose rank slices its format cannot hold (tp/quant_shard.py)."""
    cfg = source.config()
    arch = cfg.get("model_type")
    if arch not in TP_ARCHITECTURES:
        raise Unsupported(f"{source.description}: tensor_parallel_size={n}: {arch} runs on one "
                          f"device; tensor parallelism covers {', '.join(TP_ARCHITECTURES)}")
    if cfg.get("quantization_config"):   # every rank's slice of the quantized linears
        from .quant_weights import check_row_parallel
        meta = source.metadata()
        check_row_parallel(meta, plan_shards(meta, 0, n, source.description, expert_parallel),
                           f"{source.description}: tensor_parallel_size={n}")


def check_tensor_parallel_size(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"tensor_parallel_size must be an int >= 1, got {n!r}")
    return n


def rank_device(device, ranks: RankInfo):
    """The device of this rank: "cuda" / "auto" with a GPU -> cuda:<local rank> (cuda:0 when
    each rank sees one GPU); anything else as given."""
    if not isinstance(device, str):
        return device
    d = device.strip().lower()
    if d in ("cuda", "auto"):
        from ...gpu_runtime import cuda_available
        ok, _ = cuda_available()
        if not ok:
            return device
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        if ranks.local_rank < n:
            return f"cuda:{ranks.local_rank}"
        if n == 1:
            return "cuda:0"
        raise TensorParallelError(f"rank {ranks.rank}: local rank {ranks.local_rank} has no "
                                  f"GPU of its own ({n} visible)")
    return device


def load_rank(device, path_or_source, *, tensor_parallel_size: int,
              tp_timeout_s: float | None = None, tp_rendezvous: str | None = None,
              ranks: RankInfo | None = None, **options) -> TensorParallelModel:
    """This process's rank of a checkpoint (a path or `ModelSource`) split over
    `tensor_parallel_size` processes.

    Every rank joins the launch's group first (bounded by the timeout) and only then opens
    the checkpoint, plans its slices and picks its device: an error there on one rank (a bad
    config.json, a truncated file) reaches the others through the group, instead of leaving
    them waiting in MPI's initialisation for a rank that left. From then on SIGINT ends the
    whole job (gpu_runtime/comm/interrupts.py) until `teardown`."""
    N = check_tensor_parallel_size(tensor_parallel_size)
    expert_parallel = options.pop("expert_parallel", False)
    if not isinstance(expert_parallel, bool):
        raise InvalidArgument(f"expert_parallel must be a bool, got {expert_parallel!r}")
    ranks = launcher_ranks() if ranks is None else ranks
    timeout = DEFAULT_TIMEOUT_S if tp_timeout_s is None else float(tp_timeout_s)
    if not timeout > 0:
        raise InvalidArgument(f"tp_timeout_s must be > 0, got {tp_timeout_s!r}")
    if ranks.size != N:
        # no group of N waits on this rank: a checkpoint refused by name says so first
        refuse_unsharded(open_source(path_or_source), N, expert_parallel)
        raise TensorParallelError(
            f"tensor_parallel_size={N} but this process is rank {ranks.rank} of {ranks.size} "
            f"({ranks.launcher}): start one process per rank, e.g. {launch_hint(N)}")
    interrupts = AbortOnInterrupt(ranks.rank, N)
    group = comm = model = None
    try:
        group = join_group(ranks, timeout_s=timeout)
        source, plan, backend, record = _prepare_rank(group, device, path_or_source, ranks,
                                                      N, options, expert_parallel)
        comm = open_communicator(backend, ranks, timeout_s=timeout, rendezvous=tp_rendezvous,
                                 group=group)
        try:
            if group is None:   # torchrun: the communicator is the first channel
                settle(comm, record, None, mismatch=_LOAD_MISMATCH)
            model = TensorParallelModel(backend, source, comm=comm, plan=plan, group=group,
                                        interrupts=interrupts, **options)
        except Exception as e:
            if not is_agreed(e) and not isinstance(e, TensorParallelError):
                settle(comm, error_record(e), e)   # tell the others, raise the first error
            raise
        agree_values(comm, b"loaded")
    except BaseException:
        if model is not None:
            model._release_device()
        for part in (comm, group):
            if part is not None:
                part.close()
        interrupts.release()
        raise
    return model


_LOAD_MISMATCH = "load different checkpoints or options"


def fail_rank(error: BaseException, tensor_parallel_size: int,
              tp_timeout_s: float | None = None) -> None:
    """Raise `error`, a failure of this rank before it called `load_rank` (a command line
    opening the checkpoint first), after handing it to the other ranks: they are joining
    the launch's group to load, and without it would wait there until their timeout. Joins
    the group (bounded) and settles the error record where `_prepare_rank` settles, so the
    others raise it naming this rank. A process that is no rank of such a launch raises at
    once."""
    try:
        ranks = launcher_ranks()
    except TensorParallelError:
        raise error from None
    if tensor_parallel_size <= 1 or ranks.size != tensor_parallel_size:
        raise error
    timeout = DEFAULT_TIMEOUT_S if tp_timeout_s is None else float(tp_timeout_s)
    group = join_group(ranks, timeout_s=timeout)
    try:
        if group is not None:
            settle(group, error_record(error), error, name_rank=True)
    finally:
        if group is not None:
            group.close()
    raise error


def _prepare_rank(group, device, path_or_source, ranks: RankInfo, n: int, options: dict,
                  expert_parallel: bool = False):
    """(source, shard plan, backend, agreement record) of this rank, agreed over `group`
    (None: torchrun, each rank raises its own errors): every rank raises a failing rank's
    error, the others' message naming that rank; different checkpoints or options are
    refused."""
    try:
        source = open_source(path_or_source)
        refuse_unsharded(source, n, expert_parallel)
        plan = plan_shards(source.metadata(), ranks.rank, n, source.description,
                           expert_parallel)
        backend = backend_for(rank_device(device, ranks))
        record = ok_record(load_digest(source, n, dict(options,
                                                       expert_parallel=expert_parallel)),
                           source.description)
    except Exception as e:
        if group is not None:
            settle(group, error_record(e), e, name_rank=True)
        raise
    if group is not None:
        settle(group, record, None, mismatch=_LOAD_MISMATCH, name_rank=True)
    return source, plan, backend, record


def load_digest(source, n: int, options: dict) -> bytes:
    """What every rank must load alike: the config, the tensors' names and shapes, N and the
    load options (the progress bar aside)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(source.config(), sort_keys=True, default=str).encode())
    for name in sorted(source.tensor_names()):
        h.update(f"{name}{tuple(source.tensor_shape(name))}".encode())
    h.update(repr(n).encode())
    h.update(repr(sorted((k, repr(v)) for k, v in options.items() if k != "progress")).encode())
    return h.digest()
