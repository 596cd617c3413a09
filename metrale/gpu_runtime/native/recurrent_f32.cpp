// The decode steps of the recurrent layers computed natively: HostBackend's fast path for
// the twins of kernels/gated_delta_rule.cu::gdr_decode and kernels/mamba2_ssd.cu::mamba2_step
// (metrale/ops/gated_delta_rule.py, mamba2_ssd.py), built and loaded by
// metrale/gpu_runtime/native_recurrent.py. A step reads and writes each head's FP32 state
// once (the head's 16-256 KiB stay in cache between the two loops), so batch-1 decode is
// bound by the state bytes; numpy needs four or more passes over them.
//
// Float32, no FMA (built with -ffp-contract=off): every product and every sum rounded on its
// own, sums in the order written, from +0. The numpy twins compute the same steps in the
// same order when this library is missing, so both paths give the same bits.
//
// mr_gdr_step, heads [h0, h1) of one sequence; S [H, dk, dv], kn, qn [H, dk] (normalised
// key and scaled query), v [H, dv], e = exp(g), beta [H]; out [H, dv]:
//   a[j] = sum_i S[i][j] kn[i],  c[j] = sum_i S[i][j] qn[i],  kq = sum_i kn[i] qn[i]
//   u[j] = beta (v[j] - e a[j]);  out[j] = e c[j] + u[j] kq;  S[i][j] = e S[i][j] + kn[i] u[j]
// mr_ssd_step, heads [h0, h1); S [H, P, N], x [H, P], dtB [H, N] (dt B of the head's group),
// C [H, N], dA [H] (exp(dt A)), D [H]; y [H, P]:
//   S[p][n] = S[p][n] dA + x[p] dtB[n];  y[p] = dot(S[p], C) + D x[p], N % 8 == 0, where
//   dot: lane l = 0..7 sums S[p][n] C[n] for n = l, l + 8, ... in order from +0, then
//   ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (8 independent chains: SIMD lanes).
#include <cstdint>
#include <vector>

extern "C" void mr_gdr_step(float *S, const float *kn, const float *qn, const float *v,
                            const float *e, const float *beta, float *out, int64_t h0,
                            int64_t h1, int64_t dk, int64_t dv) {
    std::vector<float> a(dv), c(dv), u(dv);
    for (int64_t h = h0; h < h1; ++h) {
        float *s = S + h * dk * dv;
        const float *k = kn + h * dk, *q = qn + h * dk;
        for (int64_t j = 0; j < dv; ++j) a[j] = c[j] = 0.f;
        float kq = 0.f;
        for (int64_t i = 0; i < dk; ++i) {
            const float *row = s + i * dv;
            const float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < dv; ++j) {
                a[j] = a[j] + row[j] * ki;
                c[j] = c[j] + row[j] * qi;
            }
            kq = kq + ki * qi;
        }
        const float eh = e[h], bh = beta[h];
        float *o = out + h * dv;
        const float *vh = v + h * dv;
        for (int64_t j = 0; j < dv; ++j) {
            u[j] = bh * (vh[j] - eh * a[j]);
            o[j] = eh * c[j] + u[j] * kq;
        }
        for (int64_t i = 0; i < dk; ++i) {
            float *row = s + i * dv;
            const float ki = k[i];
            for (int64_t j = 0; j < dv; ++j) row[j] = eh * row[j] + ki * u[j];
        }
    }
}

extern "C" void mr_ssd_step(float *S, const float *x, const float *dtB, const float *C,
                            const float *dA, const float *D, float *y, int64_t h0, int64_t h1,
                            int64_t P, int64_t N) {
    for (int64_t h = h0; h < h1; ++h) {
        const float da = dA[h], dh = D[h];
        const float *b = dtB + h * N, *cc = C + h * N;
        for (int64_t p = 0; p < P; ++p) {
            float *row = S + (h * P + p) * N;
            const float xp = x[h * P + p];
            float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int64_t n = 0; n < N; n += 8) {
                for (int l = 0; l < 8; ++l) {
                    const float s = row[n + l] * da + xp * b[n + l];
                    row[n + l] = s;
                    lane[l] = lane[l] + s * cc[n + l];
                }
            }
            const float acc = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                              ((lane[4] + lane[5]) + (lane[6] + lane[7]));
            y[h * P + p] = acc + dh * xp;
        }
    }
}
