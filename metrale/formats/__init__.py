"""Layer 2: checkpoints. `ModelSource` (directory or random in-memory weights), safetensors
parsing with validation, `ModelMetadata` from config.json, and weight upload.

One direction inside: field_table (every HF config field: honoured, refused or irrelevant)
<- config_fields <- decoder_fields, rope_config, multimodal <- metadata (config.json is
parsed first) <- layout (the tensors derived from the metadata) <- config_bounds (counts and
sizes bounded by the tensors held) <- source (reads the files and checks them against the
layout: missing, mis-shaped and unused tensors)."""
from .field_table import FIELD_TABLE, HF_ACTIVATIONS
from .layout import expected_tensors, num_parameters
from .metadata import ARCHITECTURES, DECODER_ARCHS, ModelMetadata, RopeScaling, parse_rope
from .multimodal import VisionConfig, WhisperConfig
from .presets import PRESETS, preset_config
from .safetensors import SafetensorsFile, TensorInfo, parse_header, to_bf16
from .source import DirectorySource, MemorySource, ModelSource, check_tensors, open_source
from .upload import WeightUploader

__all__ = [
    "ModelSource", "DirectorySource", "MemorySource", "open_source", "PRESETS", "preset_config",
    "ModelMetadata", "RopeScaling", "WhisperConfig", "VisionConfig", "parse_rope",
    "ARCHITECTURES", "DECODER_ARCHS", "expected_tensors", "num_parameters", "check_tensors",
    "WeightUploader", "FIELD_TABLE", "HF_ACTIVATIONS",
    "SafetensorsFile", "TensorInfo", "parse_header", "to_bf16",
]
