/* int4 x float32 matmul for AVX2 (llama.cpp's way: activations to int8, _mm256_maddubs_epi16 dot products), for
 * CPUs where torch's int4 kernel is slow. Compiled at first use by nodes/engine/kernels/build.py.
 *
 * Weights: q [N, K/2] bytes, each row's group g of 32 as 16 bytes, byte i = q[32g + i] | q[32g + 16 + i] << 4 (GGUF's
 * Q4 order); dm [N, 2, G] float16: d then m per group, w = d q + m (GGUF Q4_0 / Q4_1 exactly).
 * Activations: each group of 32 of a row, scaled by a power of two s = 2^e with max |x| / s <= 127, becomes two int8
 * terms a = round(x / s) and b = round((x - a s) * 128 / s), so x ~ (128 a + b) s / 128 with an error of at most
 * s / 256 (<= max |x| / 16256): with the products summed exactly in int32, the result is the exact product of the
 * weights as stored with these activations, rounded a few times in float32 (tests/test_kernels.py holds its bound).
 * The scales are powers of two, so an activation that is exact in 14 bits (an identity matrix's 1) gives the
 * weights back bit for bit: d q exactly, then + m once, as GGUF's de-quantization rounds.
 * Each output is summed in one fixed order whatever rows share its call and however rows split across threads. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define GROUP 32
#define MT 4 /* activation rows per pass over a weight row: its bytes are unpacked once for them */

/* x [M, K] -> a, b int8 [M, K], s / 128 [M, G] and the sum of each group of x [M, G]. */
void prima_q4_quantize(const float *x, int8_t *a, int8_t *b, float *step, float *sums, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < m * groups; i++) {
        const float *v = x + i * GROUP;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
            sum += v[j];
        }
        int e = 0;
        frexpf(amax / 127.0f, &e); /* amax / 127 < 2^e */
        const float s = amax > 0.0f ? ldexpf(1.0f, e) : 1.0f;
        for (int j = 0; j < GROUP; j++) {
            const float hi = nearbyintf(v[j] / s);
            a[i * GROUP + j] = (int8_t)hi;
            b[i * GROUP + j] = (int8_t)nearbyintf((v[j] - hi * s) * (128.0f / s)); /* x - hi s: exact */
        }
        step[i] = s / 128.0f;
        sums[i] = sum;
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sum over groups of m[g] * sums[g], in 8 lanes then their sum: one order for every call. */
static inline float m_dot(const uint16_t *mh, const float *sums, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mh + g))), _mm256_loadu_ps(sums + g),
                              acc);
    float tot = hsum8(acc);
    for (; g < groups; g++) tot = fmaf(_cvtsh_ss(mh[g]), sums[g], tot);
    return tot;
}

/* y [M, N] = x @ w.T for weight rows [n0, n1) and activation rows [r0, r0 + mt), mt <= MT. */
static inline void rows_tile(const uint8_t *q, const uint16_t *dm, const int8_t *a, const int8_t *b,
                             const float *step, const float *sums, float *y, int64_t r0, int64_t mt, int64_t n,
                             int64_t k, int64_t row) {
    const int64_t groups = k / GROUP;
    const uint8_t *qr = q + row * (k / 2);
    const uint16_t *dr = dm + row * 2 * groups;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), big = _mm256_set1_epi16(128);
    __m256 acc[MT];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qr + g * 16));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low); /* 32 x u8 */
        const float d = _cvtsh_ss(dr[g]);
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const int64_t off = (r0 + r) * k + g * GROUP;
                const __m256i pa = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(a + off)));
                const __m256i pb = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(b + off)));
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pa, big), _mm256_madd_epi16(pb, ones));
                const __m256 scale = _mm256_set1_ps(d * step[(r0 + r) * groups + g]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
            }
        }
    }
    for (int r = 0; r < mt; r++)
        y[(r0 + r) * n + row] = hsum8(acc[r]) + m_dot(dr + groups, sums + (r0 + r) * groups, groups);
}

void prima_q4_mm(const uint8_t *q, const uint16_t *dm, const int8_t *a, const int8_t *b, const float *step,
                 const float *sums, float *y, int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n; row++)
        for (int64_t r0 = 0; r0 < m; r0 += MT) rows_tile(q, dm, a, b, step, sums, y, r0, m - r0 < MT ? m - r0 : MT,
                                                          n, k, row);
}

/* out [N, K/2] in this kernel's order from torch's packed layout of whole blocks of `block` rows ("lanes": row j
 * of a block in byte j's low nibble, row j + block/2 in byte j's high one; else rows 2j, 2j + 1); out zeroed. */
void prima_q4_from_torch(const uint8_t *packed, uint8_t *out, int64_t n, int64_t k, int block, int lanes,
                         int threads) {
    const int half = block / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < n / block; b++)
        for (int j = 0; j < block; j++) {
            const int byte = lanes ? j % half : j / 2, high = lanes ? j >= half : j & 1;
            uint8_t *dst = out + (b * block + j) * (k / 2);
            for (int64_t kk = 0; kk < k; kk++) {
                const uint8_t p = packed[(b * k + kk) * half + byte];
                const uint8_t v = high ? p >> 4 : p & 15;
                const int64_t i = kk % GROUP;
                dst[kk / GROUP * 16 + i % 16] |= i < 16 ? v : (uint8_t)(v << 4);
            }
        }
}
