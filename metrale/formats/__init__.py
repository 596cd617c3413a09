"""Layer 2: checkpoints. `ModelSource` (directory or random in-memory weights), safetensors
parsing with validation, `ModelMetadata` from config.json, and weight upload.

One direction inside: config_fields <- multimodal <- metadata (config.json is parsed first)
<- layout (the tensors derived from the metadata) <- source (reads the files and checks them
against the layout)."""
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
    "WeightUploader",
    "SafetensorsFile", "TensorInfo", "parse_header", "to_bf16",
]
