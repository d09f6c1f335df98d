/* float32 x float32 matmul for few activation rows (decode steps, verify frames), built per instruction set like
 * q4.c (nodes/engine/kernels/build.py). A decode step reads every weight once from memory: torch's GEMM for a row or
 * two read SmolLM2's float32 weights at ~7 GB/s on a 2-core Xeon where llama.cpp's F32 path read ~21. Here each
 * weight row is read once for all the call's rows. AVX-512 builds take RB rows at a time, the rows two tiles ahead
 * asked into the cache; AVX2 builds one row at a time, front to back, so a thread's rows are one sequential stream
 * for the hardware prefetcher (SmolLM2's float32 layers on a 2-core AVX2 Zen 3: 13.9 -> 17.4 GB/s for one row,
 * 10.1 -> 16.9 for four; the tiles' explicit prefetch only slowed it there). Each output is summed in one fixed
 * order whatever rows share its call and however rows split across threads: a row's result is the same alone, in a
 * verify frame or in a batch. aarch64 builds (NEON) run AVX2's way, its 8 lanes as two 4-lane registers: the same
 * fmas and sums in the same order, so the same bits as AVX2. */
#include <stdint.h>
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif

#if defined(__aarch64__)
#define VW 8
typedef struct {
    float32x4_t lo, hi; /* AVX2's lanes 0-3 and 4-7 */
} vec;
static inline vec zero(void) { return (vec){vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
static inline vec fma8(vec a, vec b, vec c) { return (vec){vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
static inline vec add8(vec a, vec b) { return (vec){vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
/* lanes [k, k + VW) of p, zeros past n (the tail of a row) */
static inline vec load(const float *p, int64_t k, int64_t n) {
    if (k + VW <= n) return (vec){vld1q_f32(p + k), vld1q_f32(p + k + 4)};
    float t[VW] = {0};
    for (int64_t j = 0; j < n - k; j++) t[j] = p[k + j];
    return (vec){vld1q_f32(t), vld1q_f32(t + 4)};
}
/* AVX2's order: lanes j + (j + 4), then (0 + 2) + (1 + 3) */
static inline float hsum(vec v) {
    const float32x4_t s = vaddq_f32(v.lo, v.hi);
    const float32x2_t h = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
}
#define RB 1
#define MT 4
#define U 2 /* accumulators along K: chunk c (of VW lanes) sums into acc[c % U] */
#elif defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
#define ZERO() _mm512_setzero_ps()
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
/* lanes [k, k + VW) of p, zeros past n (the tail of a row) */
static inline vec load(const float *p, int64_t k, int64_t n) {
    if (k + VW <= n) return _mm512_loadu_ps(p + k);
    return _mm512_maskz_loadu_ps((__mmask16)((1u << (n - k)) - 1), p + k);
}
static inline float hsum(vec v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define RB 4
#define MT 4
#define AHEAD_TILES 2
#else
#define VW 8
typedef __m256 vec;
#define ZERO() _mm256_setzero_ps()
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline vec load(const float *p, int64_t k, int64_t n) {
    if (k + VW <= n) return _mm256_loadu_ps(p + k);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p + k, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - k)), lane));
}
static inline float hsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define RB 1
#define MT 4
#define U 2 /* accumulators along K: chunk c (of VW lanes) sums into acc[c % U] */
#endif

#include "cpu_ok.h" /* prima_cpu_ok: build.py loads a build only where this CPU runs it */

#if defined(__AVX512F__)
/* y [M, N] for weight rows [row, row + RB) (those below N) and activation rows [r0, r0 + mt), mt <= MT. */
static inline void tile(const float *w, const float *x, float *y, int64_t r0, int64_t mt, int64_t n, int64_t k,
                        int64_t row) {
    const float *wr[RB];
    for (int i = 0; i < RB; i++) wr[i] = w + (row + i < n ? row + i : n - 1) * k; /* past N: row N-1, unstored */
    if (r0 == 0 && row + RB * (AHEAD_TILES + 1) <= n)
        for (int64_t o = 0; o < RB * k * (int64_t)sizeof(float); o += 64)
            _mm_prefetch((const char *)(w + (row + RB * AHEAD_TILES) * k) + o, _MM_HINT_T0);
    vec acc[RB][MT];
    for (int i = 0; i < RB; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = ZERO();
    for (int64_t c = 0; c < k; c += VW) {
        vec wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = load(wr[i], c, k);
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const vec xv = load(x + (r0 + r) * k, c, k);
                for (int i = 0; i < RB; i++) acc[i][r] = FMA(wv[i], xv, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < RB && row + i < n; i++)
        for (int r = 0; r < mt; r++) y[(r0 + r) * n + row + i] = hsum(acc[i][r]);
}

#elif defined(__aarch64__)
/* y [M, N] for weight row ROW and activation rows [r0, r0 + mt), mt <= MT: AVX2's tile below, step for step. */
static inline void tile(const float *w, const float *x, float *y, int64_t r0, int64_t mt, int64_t n, int64_t k,
                        int64_t row) {
    const float *wr = w + row * k;
    vec acc[MT][U];
    for (int r = 0; r < MT; r++)
        for (int u = 0; u < U; u++) acc[r][u] = zero();
    int64_t c = 0;
    for (; c + VW * U <= k; c += VW * U) {
        vec wv[U];
        for (int u = 0; u < U; u++) wv[u] = load(wr, c + u * VW, k);
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const float *xr = x + (r0 + r) * k;
                for (int u = 0; u < U; u++) acc[r][u] = fma8(wv[u], load(xr, c + u * VW, k), acc[r][u]);
            }
        }
    }
    for (int u = 0; c < k; c += VW, u++) { /* the tail: fewer than U chunks, the last one zero-padded */
        const vec wv = load(wr, c, k);
        for (int r = 0; r < MT; r++)
            if (r < mt) acc[r][u] = fma8(wv, load(x + (r0 + r) * k, c, k), acc[r][u]);
    }
    for (int r = 0; r < mt; r++) {
        vec sum = acc[r][0];
        for (int u = 1; u < U; u++) sum = add8(sum, acc[r][u]);
        y[(r0 + r) * n + row] = hsum(sum);
    }
}

#else
/* y [M, N] for weight row ROW and activation rows [r0, r0 + mt), mt <= MT. */
static inline void tile(const float *w, const float *x, float *y, int64_t r0, int64_t mt, int64_t n, int64_t k,
                        int64_t row) {
    const float *wr = w + row * k;
    vec acc[MT][U];
    for (int r = 0; r < MT; r++)
        for (int u = 0; u < U; u++) acc[r][u] = ZERO();
    int64_t c = 0;
    for (; c + VW * U <= k; c += VW * U) {
        vec wv[U];
        for (int u = 0; u < U; u++) wv[u] = _mm256_loadu_ps(wr + c + u * VW);
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const float *xr = x + (r0 + r) * k + c;
                for (int u = 0; u < U; u++) acc[r][u] = FMA(wv[u], _mm256_loadu_ps(xr + u * VW), acc[r][u]);
            }
        }
    }
    for (int u = 0; c < k; c += VW, u++) { /* the tail: fewer than U chunks, the last one masked */
        const vec wv = load(wr, c, k);
        for (int r = 0; r < MT; r++)
            if (r < mt) acc[r][u] = FMA(wv, load(x + (r0 + r) * k, c, k), acc[r][u]);
    }
    for (int r = 0; r < mt; r++) {
        vec sum = acc[r][0];
        for (int u = 1; u < U; u++) sum = _mm256_add_ps(sum, acc[r][u]);
        y[(r0 + r) * n + row] = hsum(sum);
    }
}
#endif

/* y [M, N] = x [M, K] @ w.T for float32 w [N, K], all contiguous. */
void prima_f32_mm(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < n; row += RB)
        for (int64_t r0 = 0; r0 < m; r0 += MT) tile(w, x, y, r0, m - r0 < MT ? m - r0 : MT, n, k, row);
}
