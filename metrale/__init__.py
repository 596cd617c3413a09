"""metrale: a CuPy-based, low-level LLM inference runtime with a raw-pointer model API.

`import metrale` loads only the errors (no numpy: the `metrale` command catches a Ctrl-C
from its first lines on); `CacheConfig` and every public subpackage (`metrale.engine`,
`metrale.audio`, `metrale.formats`, ...) are imported on first attribute access through the
module `__getattr__` below, so the import stays fast and torch/CuPy-free.
"""
import importlib

from .errors import (AdapterPoolFull, CacheFull, ConcurrentUse, DeviceError, FormatError,
                     InvalidArgument, KernelError, MetraleError, NonFiniteLogits, OutOfMemory,
                     TensorParallelError, Unsupported, UnsupportedMedia)

__version__ = "0.1.0"
__all__ = ["MetraleError", "FormatError", "Unsupported", "UnsupportedMedia", "CacheFull",
           "InvalidArgument", "DeviceError", "OutOfMemory", "KernelError", "ConcurrentUse",
           "NonFiniteLogits", "AdapterPoolFull",
           "TensorParallelError", "CacheConfig",
           "to_numpy", "load", "load_generative", "device_array"]

# Subpackages and modules `metrale.X` reaches after a plain `import metrale`: every layer up
# to the engine (DESIGN §1). The shell's layer above it (`metrale.bench`, `metrale.cli`) is
# imported explicitly, so the package never reaches upward.
SUBMODULES = ("api", "audio", "engine", "errors", "formats", "generative", "gpu_runtime",
              "kv", "model_engine", "ops", "vision", "whisper")


def __getattr__(name):
    if name == "CacheConfig":
        from .kv.config import CacheConfig
        globals()[name] = CacheConfig
        return CacheConfig
    if name in SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module   # later lookups skip __getattr__
        return module
    raise AttributeError(f"module 'metrale' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(SUBMODULES) | {"CacheConfig"})


def load(path_or_source, device="auto", **options):
    """Load a checkpoint for the pointer API (see `metrale.api.load`)."""
    from .api import load as _load
    return _load(path_or_source, device, **options)


def load_generative(path_or_source, device="auto", **load_options):
    """Load a checkpoint for the tensor contract (see `metrale.api.load_generative`)."""
    from .api import load_generative as _load_generative
    return _load_generative(path_or_source, device, **load_options)


def to_numpy(x):
    """Copy any array metrale returns (numpy on CPU, CuPy on CUDA) to a numpy array."""
    from .gpu_runtime.arrays import to_numpy as _to_numpy
    return _to_numpy(x)


def device_array(ptr, shape, dtype, device):
    """A zero-copy numpy (host) or CuPy (CUDA) array over device memory at `ptr`, owned by
    `device` (a model or backend); see `metrale.gpu_runtime.views.device_array`."""
    from .gpu_runtime.views import device_array as _device_array
    return _device_array(ptr, shape, dtype, device)
