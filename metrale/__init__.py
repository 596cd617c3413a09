"""metrale: a CuPy-based, low-level LLM inference runtime with a raw-pointer model API."""
from .errors import (CacheFull, ConcurrentUse, DeviceError, FormatError, InvalidArgument,
                     KernelError, MetraleError, Unsupported, UnsupportedMedia)

__version__ = "0.1.0"
__all__ = ["MetraleError", "FormatError", "Unsupported", "UnsupportedMedia", "CacheFull",
           "InvalidArgument", "DeviceError", "KernelError", "ConcurrentUse"]


def load(path_or_source, device="auto", **options):
    """Load a checkpoint for the pointer API (see `metrale.api.load`)."""
    from .api import load as _load
    return _load(path_or_source, device, **options)
