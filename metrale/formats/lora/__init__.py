"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) read and checked
against a base model: config.py (the fields), targets.py (PEFT's target matching over the
base's module names), adapter.py (the tensors)."""
from .adapter import LoraAdapter, LoraModule, adapter_rank, read_adapter
from .config import MAX_RANK, AdapterConfig, parse_config, read_config
from .targets import SERVED, base_modules, targeted

__all__ = ["LoraAdapter", "LoraModule", "AdapterConfig", "read_adapter", "read_config",
           "parse_config", "adapter_rank", "targeted", "base_modules", "SERVED", "MAX_RANK"]
