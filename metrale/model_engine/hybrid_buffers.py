"""Device buffers the hybrid layer passes use beside the dense decoders' Workspace: the
DeltaNet projection, conv output and core output, the attention's output gate, and the
recurrent step's per-sequence slots and start positions (uploaded before each pass, at fixed
addresses, so a captured decode graph reads each step's). Allocated once at load."""
from __future__ import annotations

import numpy as np

from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import NULL
from .hybrid_weights import proj_width
from .nemotron import mamba_proj_width


def _widths(meta) -> tuple[int, int, int]:
    """(padded input projection, conv channels, recurrent output) of the recurrent layers."""
    g, mb = meta.hybrid.gdn, meta.hybrid.mamba
    if mb is not None:
        return mamba_proj_width(mb), mb.conv_dim, mb.inner
    if g is not None:
        return proj_width(g), g.conv_dim, g.value_dim
    return 0, 0, 0


class HybridBuffers(OwnedBuffers):
    """Buffers for up to `rows` token rows (max(max_tokens, max_rows)) of model `meta`."""

    def __init__(self, backend, meta, rows: int) -> None:
        self.backend, self._owned = backend, []
        self.rows = int(rows)
        self.proj_width = _widths(meta)[0]
        try:
            for name, nbytes in self.layout(meta, rows).items():
                setattr(self, name, self._alloc(nbytes) if nbytes else NULL)
        except BaseException:
            self.free()
            raise
        self.h_slots = np.zeros(self.rows, np.int32)
        self.h_start = np.zeros(self.rows, np.int32)

    @staticmethod
    def layout(meta, rows: int) -> dict[str, int]:
        T = int(rows)
        pw, conv, core = _widths(meta)
        gated = meta.hybrid.mamba is None   # the Qwen hybrids' attention output gate
        return {
            "proj": T * pw * 2,           # [T, proj_width]: q|k|v|z or z|x B C|dt
            "conv": T * conv * 2,         # [T, conv_dim] conv output
            "core": T * core * 2,         # [T, value_dim / inner] delta rule / SSD output
            "ab": T * 2 * meta.hybrid.gdn.num_v_heads * 2 if meta.hybrid.gdn else 0,  # b | a
            "gate": T * meta.num_heads * meta.head_dim * 2 if gated else 0,   # [T, H * D]
            "slots": T * 4,                               # int32 [rows or sequences]
            "start_pos": T * 4,                           # int32 [sequences]
        }

    @staticmethod
    def estimate_bytes(meta, rows: int) -> int:
        return sum(HybridBuffers.layout(meta, rows).values())

    def upload(self, stream: int, n: int, start: bool) -> None:
        """Copy the first n staged slots (and start positions) to the device."""
        self.backend.copy_h2d_async(self.h_slots[:n], self.slots, stream)
        if start:
            self.backend.copy_h2d_async(self.h_start[:n], self.start_pos, stream)
