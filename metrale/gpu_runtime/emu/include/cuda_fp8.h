// Stub for the EmuBackend build: FP16 and FP8 types and conversions come from the emulator's
// fp16_fp8.h (as the real <cuda_fp8.h> brings <cuda_fp16.h> and <cuda_bf16.h> with it).
#pragma once
#include "../fp16_fp8.h"
