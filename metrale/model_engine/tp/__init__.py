"""Tensor parallelism (DESIGN §6): one rank of a decoder split over N devices, SPMD.

  shard.py            which slice of every weight a rank holds, checked before any upload
  sharded_weights.py  a rank's slices on its device, in the single-device layout
  runtime.py          how a rank's layer passes end: the fixed-order combines
  model.py            `TensorParallelModel`, the pointer API over all of it
  lora_shard.py       a rank's slice of a LoRA adapter (A like the input, B like the output)
  moe_shard.py        a rank's experts (a slice of each, or whole ones) and the TP combine
  expert_parallel.py  expert parallelism: tokens dispatched and combined by all-to-all
  ep_contract.py      the original's ModelEp contract on SPMD ranks
"""
