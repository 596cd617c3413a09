// Stub for the EmuBackend build: BF16 and the rest come from the force-included shim
// (metrale/gpu_runtime/emu/shim.h); the FP16 types and conversions from fp16_fp8.h.
#pragma once
#include "../fp16_fp8.h"
