"""Quantized decoder checkpoints (DESIGN §6): a `quantization_config` -> a family's config
object (parse.py; fp8.py: fine-grained and compressed-tensors FP8; int4.py: GPTQ and AWQ
4-bit).

A config object answers `converts(module)`, `tensor_specs(module, n, k)` (name -> (shape,
dtypes, required)), `check_shape`, `read(source, module, n, k)` (the module's tensors
checked and repacked into the device layout) and `describe()`. layout.py derives the
tensors a quantized checkpoint holds; checkpoint.py checks them before any upload (the
value checks of `read` run before the module's bytes are uploaded); fields.py and rules.py
list and check the config's keys.
"""
