// Stub for the EmuBackend build: everything a kernel uses from <cuda_bf16.h> is provided by the
// force-included shim (metrale/gpu_runtime/emu/shim.h), so this header is empty on purpose.
#pragma once
