"""What `run_bench` does differently on a tensor-parallel rank (`BenchConfig.tensor_parallel`
N > 1, every one of N processes running the bench under a launcher, rank 0 reporting).

The ranks must make the same calls, so there is no time budget (it would cut the ranks at
different steps) and no Hugging Face comparison (one device). Each row adds
`allreduce_ms_per_step` (one decode step's combines at that batch size, the embedding's and
2 per layer's fixed-order reductions and the logits gather with their kernels, timed alone:
`TensorParallel.time_step_collectives`) and `allreduce_bytes_per_step` (bytes each rank
receives); `hbm_gb_s` counts the rank's own weights and KV heads (`roofline.model_step_bytes`).
"""
from __future__ import annotations

from ..errors import InvalidArgument


def check(tp, max_seconds, peer=None) -> None:
    """InvalidArgument for a tensor_parallel value or a setting it cannot run with."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InvalidArgument(f"tensor_parallel must be an int >= 1, got {tp!r}")
    if tp > 1 and max_seconds is not None:
        raise InvalidArgument("max_seconds cannot be used with tensor parallelism: every rank "
                              "must time the same steps")
    if tp > 1 and peer is not None:
        raise InvalidArgument("the Hugging Face comparison runs on one device, not with "
                              "tensor parallelism")


def rank_backend(device, tp: int):
    """The backend of this process: the rank's own GPU ("cuda" / "auto") when tp > 1."""
    from ..gpu_runtime import backend as pick_backend
    if tp == 1:
        return pick_backend(device)
    from ..gpu_runtime.comm.ranks import launcher_ranks
    from ..model_engine.tp.model import rank_device
    return pick_backend(rank_device(device, launcher_ranks()))


def load_model(backend, source, tp: int, **options):
    """A TransformerModel (a HybridModel for the recurrent families), or this rank's
    TensorParallelModel when tp > 1."""
    if tp == 1:
        from ..model_engine import HybridModel, TransformerModel
        hybrid = source.metadata().hybrid is not None
        return (HybridModel if hybrid else TransformerModel)(backend, source, **options)
    from ..model_engine.tp.model import load_rank
    return load_rank(backend, source, tensor_parallel_size=tp, **options)


def comm_columns(model, stream: int, batch: int) -> dict:
    """A row's all-reduce time and bytes per decode step (none without tensor parallelism,
    and none with expert parallelism: its all-to-alls depend on the routing and are not the
    reductions these columns time and count; benchmarks/tp_moe_model.py models them). A MoE
    block split inside its experts ends with one reduction, as a dense MLP does."""
    if model._tp is None or model._tp.ep is not None:
        return {}
    layers = model.metadata().num_layers
    return {"allreduce_ms_per_step": model._tp.time_step_collectives(stream, batch, layers),
            "allreduce_bytes_per_step": model._tp.step_bytes(batch, layers)}
