"""The one error hierarchy: every failure a user can cause is a `MetraleError` subclass.

Messages name the file, tensor, argument or limit at fault. Errors are raised before any
kernel is launched, so nothing on the device has been touched when one reaches the caller.
"""


class MetraleError(Exception):
    """Base class of every error metrale raises on purpose."""


class FormatError(MetraleError):
    """A checkpoint, config or safetensors file is missing, malformed or inconsistent."""


class Unsupported(MetraleError):
    """An architecture, option or method this model or build does not provide."""


class UnsupportedMedia(Unsupported):
    """Images or audio passed to a model that cannot take them."""


class CacheFull(MetraleError):
    """The paged KV pool has too few free blocks; nothing in the pool was changed."""


class AdapterPoolFull(MetraleError):
    """Every LoRA adapter slot a promotion may take has in-flight sequences; nothing was
    changed, and the promotion may succeed once a sequence is released."""


class InvalidArgument(MetraleError, ValueError):
    """An argument out of range: a token id, a position, a size, a pointer."""


class DeviceError(MetraleError):
    """The device cannot do what was asked: no GPU, out of memory, a kernel failed to build."""


class OutOfMemory(DeviceError):
    """The model does not fit the device's free memory, decided before any allocation.

    `head` says what is needed and what is free (in GiB); `fits_without_kv` is False when
    the weights (and the workspaces) alone do not fit, so no smaller KV pool helps; `hint`
    names the load options that make it fit. A command line re-words the hint with its own
    flags (`with_hint`)."""

    def __init__(self, head: str, hint: str, *, fits_without_kv: bool) -> None:
        super().__init__(f"{head}; {hint}")
        self.head, self.hint, self.fits_without_kv = head, hint, fits_without_kv

    def with_hint(self, hint: str) -> "OutOfMemory":
        return OutOfMemory(self.head, hint, fits_without_kv=self.fits_without_kv)


class KernelError(MetraleError):
    """A kernel is unknown (no `.cu` entry point or no numpy twin) or was launched wrongly."""


class ConcurrentUse(MetraleError):
    """A second thread called into a model while another call was in flight."""


class NonFiniteLogits(MetraleError):
    """A forward pass gave NaN or infinite logits (weights that hold NaN/Inf, an overflow),
    or a result computed from them is not finite: generation stops instead of picking a
    token from them, perplexity instead of reporting NaN."""


class TensorParallelError(MetraleError):
    """A tensor-parallel group cannot go on: a peer died, hung or stopped calling the model
    (no answer within the group's timeout), the ranks made different calls, or a launcher's
    ranks do not match `tensor_parallel_size`. The message names the rank and the call."""
