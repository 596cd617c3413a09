// Vision-tower helpers (CLIP patch embedding). FP32 math, one RNE rounding to BF16 per
// stored element. The patch convolution itself is a GEMM (cuBLAS) over the rows `patchify`
// writes, against the conv weight [hidden, C, p, p] read as [hidden, C*p*p].
//
//   patchify:        out[py*gw + px, c*p*p + ky*p + kx] = bf16(pixels[c, py*p + ky, px*p + kx])
//                    pixels float32 [C, H, W] (one image, CHW), out bf16 [gh*gw, C*p*p],
//                    gh = H / p, gw = W / p (a stride-p, kernel-p conv without padding:
//                    the last H % p rows and W % p columns are never read).
//   class_pos_embed: x [n_rows, hidden] bf16 in place: row 0 = bf16(cls + pos[0]),
//                    row r > 0 = bf16(x[r] + pos[r])   (cls [hidden], pos [n_rows, hidden]).
//                    Row 0 of x is only written, never read.
//
// patchify launch: grid (gh*gw), block VIS_THREADS (256) striding over the C*p*p columns.
// class_pos_embed launch: grid (n_rows), block 256 striding over the row.
// Restrictions: every size in [1, 2^31); C*H*W < 2^31; rows are addressed with 64-bit
// offsets. Any alignment (one element per access; these kernels run once per image).
#include "common.cuh"

#define VIS_THREADS 256

extern "C" __global__ void __launch_bounds__(VIS_THREADS)
patchify(bf16 *out, const float *pixels, int channels, int height, int width, int patch) {
    const int gw = width / patch;
    const int n_patches = (height / patch) * gw;
    const int r = blockIdx.x;
    if (r >= n_patches) return;
    const int py = r / gw, px = r - py * gw;
    const int pp = patch * patch;
    const int cols = channels * pp;
    bf16 *row = out + (long long)r * cols;
    for (int col = threadIdx.x; col < cols; col += blockDim.x) {
        const int c = col / pp;
        const int rem = col - c * pp;
        const int ky = rem / patch, kx = rem - ky * patch;
        const long long src = ((long long)c * height + (long long)py * patch + ky) * width +
                              (long long)px * patch + kx;
        row[col] = f2bf(pixels[src]);
    }
}

extern "C" __global__ void __launch_bounds__(VIS_THREADS)
class_pos_embed(bf16 *x, const bf16 *cls, const bf16 *pos, int n_rows, int hidden) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    bf16 *row = x + (long long)r * hidden;
    const bf16 *prow = pos + (long long)r * hidden;
    if (r == 0) {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x)
            row[c] = f2bf(bf2f(cls[c]) + bf2f(prow[c]));
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x)
            row[c] = f2bf(bf2f(row[c]) + bf2f(prow[c]));
    }
}
