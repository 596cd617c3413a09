// HostBackend's native LoRA twins (gpu_runtime/native_lora.py): the shrink and expand of
// kernels/lora.cu in the kernels' float32 order, every product and every sum one IEEE
// rounding (built with -ffp-contract=off: no fused multiply-add), so the results are the bits
// of the numpy twins in metrale/ops/lora.py. The lanes of the kernels' orders are this
// code's vector lanes, which needs the weights re-laid out once (the twin caches them):
//   at  [c][K8][128] BF16   A_s: at[q][u][l] = A[q][(u / 8) * 1024 + 8 l + u % 8] (0 past
//                           k): lane l's u-th element, K8 = ceil(k / 1024) * 8
//   bt  [rp][n]      BF16   B_s transposed
// (BF16, as the pool holds them: a decode step streams every used slot's A and B, so their
// bytes, not the arithmetic, are what this costs; widening is exact.)
// Tiles are the kernels' (first row, rows, slot); a slot without a table entry (0) or
// outside [0, n_slots) is skipped, like the kernels' padding tiles.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t LANES = 128;
constexpr int64_t GROUP = 8;     // rows of one slot computed together (each weight read once)
constexpr int64_t COLS = 64;     // expand: output columns per block

inline float bf16_to_f32(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {   // round to nearest even; NaN -> 0x7FFF
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The rows of the tiles, by slot (tiles of slots without a table entry skipped): the
// per-element order does not depend on which rows are computed together.
std::vector<std::vector<int64_t>> rows_by_slot(const int32_t *tiles, int64_t n_tiles,
                                               int64_t n_slots, const void *const *table,
                                               int64_t m) {
    std::vector<std::vector<int64_t>> out(n_slots);
    for (int64_t i = 0; i < n_tiles; ++i) {
        const int64_t row0 = tiles[3 * i], rows = tiles[3 * i + 1], slot = tiles[3 * i + 2];
        if (slot < 0 || slot >= n_slots || table[slot] == nullptr || row0 < 0 || rows < 1 ||
            row0 >= m)
            continue;
        for (int64_t r = row0; r < row0 + rows && r < m; ++r) out[slot].push_back(r);
    }
    return out;
}

// out[l] = the sum over u, ascending from +0, of xt[u][l] * at[u][l] (each product and each
// sum rounded), in blocks of LB lanes whose accumulators stay in registers
constexpr int64_t LB = 32;
void lane_sums(const float *__restrict__ xt, const uint16_t *__restrict__ at, int64_t k8,
               float *__restrict__ out) {
    for (int64_t l0 = 0; l0 < LANES; l0 += LB) {
        float acc[LB] = {};
        for (int64_t u = 0; u < k8; ++u) {
            const float *__restrict__ xu = xt + u * LANES + l0;
            const uint16_t *__restrict__ au = at + u * LANES + l0;
            for (int64_t l = 0; l < LB; ++l) acc[l] = acc[l] + xu[l] * bf16_to_f32(au[l]);
        }
        for (int64_t l = 0; l < LB; ++l) out[l0 + l] = acc[l];
    }
}

// delta[jj] = the sum over q, ascending from +0, of u[q] * bt[q * n + jj], jj < W (W a
// compile-time width: the accumulators stay in registers)
template <int64_t W>
void col_sums(const float *__restrict__ u, const uint16_t *__restrict__ bt, int64_t n,
              int64_t rp, float *__restrict__ delta) {
    float acc[W] = {};
    for (int64_t q = 0; q < rp; ++q) {
        const float uq = u[q];
        const uint16_t *__restrict__ b = bt + q * n;
        for (int64_t jj = 0; jj < W; ++jj) acc[jj] = acc[jj] + uq * bf16_to_f32(b[jj]);
    }
    for (int64_t jj = 0; jj < W; ++jj) delta[jj] = acc[jj];
}

}  // namespace

extern "C" {

// t[row][q] for every row of the tiles: x bf16 [m][k], t float32 [m][c],
// at_table[slot] -> that slot's at (or 0).
void mr_lora_shrink(const uint16_t *x, const uint16_t *const *at_table, const int32_t *tiles,
                    int64_t n_tiles, int64_t n_slots, float *t, int64_t m, int64_t k,
                    int64_t c) {
    const int64_t k8 = (k + LANES * 8 - 1) / (LANES * 8) * 8;
    std::vector<float> xt(GROUP * k8 * LANES);
    alignas(64) float acc[GROUP][LANES];
    const auto by_slot = rows_by_slot(tiles, n_tiles, n_slots,
                                      reinterpret_cast<const void *const *>(at_table), m);
    for (int64_t slot = 0; slot < n_slots; ++slot) {
        const auto &rows = by_slot[slot];
        for (size_t g0 = 0; g0 < rows.size(); g0 += GROUP) {
            const int64_t ng = std::min<int64_t>(GROUP, int64_t(rows.size() - g0));
            for (int64_t g = 0; g < ng; ++g) {   // lane l's element u = 8 s + e of the row
                const uint16_t *xr = x + rows[g0 + g] * k;
                float *__restrict__ xw = xt.data() + g * k8 * LANES;
                for (int64_t s = 0; s < k8 / 8; ++s)
                    for (int64_t e = 0; e < 8; ++e)
                        for (int64_t l = 0; l < LANES; ++l) {
                            const int64_t kk = s * 1024 + 8 * l + e;
                            xw[(8 * s + e) * LANES + l] = kk < k ? bf16_to_f32(xr[kk]) : 0.f;
                        }
            }
            for (int64_t q = 0; q < c; ++q)
                for (int64_t g = 0; g < ng; ++g) {
                    float *a = acc[g];
                    lane_sums(xt.data() + g * k8 * LANES, at_table[slot] + q * k8 * LANES, k8,
                              a);
                    for (int64_t h = LANES / 2; h >= 1; h /= 2)
                        for (int64_t l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
                    t[rows[g0 + g] * c + q] = a[0];
                }
        }
    }
}

// y[row][j] = bf16(y + delta) for every row of the tiles: y bf16 [m][n], t float32 [m][c]
// (or `splits` of them t_split_stride apart, added in order),
// bt_table[slot] -> that slot's bt (or 0), scale_pool float32 [n_slots][parts].
void mr_lora_expand(uint16_t *y, const float *t, int64_t t_split_stride, int64_t splits,
                    const uint16_t *const *bt_table,
                    const float *scale_pool, const int32_t *tiles, int64_t n_tiles,
                    int64_t n_slots, int64_t m, int64_t n, int64_t rp, int64_t c,
                    int64_t parts, int64_t part1, int64_t part2) {
    std::vector<float> u(GROUP * c);
    alignas(64) float d[GROUP][COLS];
    const int64_t ends[3] = {parts > 1 ? part1 : n, parts > 2 ? part2 : n, n};
    const auto by_slot = rows_by_slot(tiles, n_tiles, n_slots,
                                      reinterpret_cast<const void *const *>(bt_table), m);
    for (int64_t slot = 0; slot < n_slots; ++slot) {
        const auto &rows = by_slot[slot];
        const uint16_t *bt = bt_table[slot];
        const float *scale = scale_pool + slot * parts;
        for (size_t g0 = 0; g0 < rows.size(); g0 += GROUP) {
            const int64_t ng = std::min<int64_t>(GROUP, int64_t(rows.size() - g0));
            for (int64_t g = 0; g < ng; ++g)
                for (int64_t q = 0; q < c; ++q) {
                    const float *tq = t + rows[g0 + g] * c + q;
                    float v = tq[0];
                    for (int64_t sp = 1; sp < splits; ++sp) v = v + tq[sp * t_split_stride];
                    u[g * c + q] = v * scale[q / rp];
                }
            int64_t j0 = 0;
            for (int64_t p = 0; p < parts; ++p) {
                const int64_t j1 = ends[p];
                for (int64_t jc = j0; jc < j1; jc += COLS) {
                    const int64_t w = std::min<int64_t>(COLS, j1 - jc);
                    for (int64_t g = 0; g < ng; ++g) {
                        const float *ug = u.data() + g * c + p * rp;
                        if (w == COLS) {
                            col_sums<COLS>(ug, bt + jc, n, rp, d[g]);
                        } else {
                            for (int64_t jj = 0; jj < w; ++jj)
                                col_sums<1>(ug, bt + jc + jj, n, rp, d[g] + jj);
                        }
                        uint16_t *yr = y + rows[g0 + g] * n + jc;
                        for (int64_t jj = 0; jj < w; ++jj)
                            yr[jj] = f32_to_bf16(bf16_to_f32(yr[jj]) + d[g][jj]);
                    }
                }
                j0 = j1;
            }
        }
    }
}

}  // extern "C"
