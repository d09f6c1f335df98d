/* int4 (and int8) x float32 matmul (llama.cpp's way: activations to int8, integer dot products), built per instruction set by
 * nodes/engine/kernels/build.py: AVX2 (_mm256_maddubs_epi16), AVX-512BW (the same 64 bytes at a time) and AVX-512
 * VNNI (_mm512_dpbusd_epi32). The build's flags pick the path (__AVX512BW__, __AVX512VNNI__).
 *
 * Weights: q [N, K/2] bytes, each row's group g of 32 as 16 bytes, byte i = q[32g + i] | q[32g + 16 + i] << 4 (GGUF's
 * Q4 order); dm [N, 2, G] float16: d then m per group, w = d q + m (GGUF Q4_0 / Q4_1 exactly).
 * Activations, one of two modes:
 *  - EXACT: each group of 32 of a row, scaled by a power of two s = 2^e with max |x| / s <= 127, becomes two int8
 *    terms a = round(x / s) and b = round((x - a s) * 128 / s), so x ~ (128 a + b) s / 128 with an error of at most
 *    s / 256 (<= max |x| / 16256). An activation exact in 14 bits (an identity's 1) gives the weights back bit for bit.
 *  - Q8: ggml's Q8_0 exactly (quantize_row_q8_0's AVX path): d = max |x| / 127 rounded to float16, q = round(x 127 /
 *    max |x|) to nearest even, x ~ d q: an error of at most max |x| / 254 plus 127 |d - fp16(d)|. One int8 term, half
 *    EXACT's dot products.
 * The products are summed exactly in int32, so the result is the exact product of the weights as stored with the
 * activations as quantized, rounded a few times in float32 (tests/test_kernels.py holds each mode's bound). Each
 * output is summed in one fixed order whatever rows share its call and however rows split across threads.
 * aarch64 builds (NEON, with or without the dot product extension) are in q4_neon.h; AVX2 builds' EXACT terms in
 * q4_x16.h, their int4 matmul of 4 and more rows (a prompt) in q4_gemm_avx2.h. */
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define EXACT 0
#define Q8 1
/* A tile: RB weight rows, unpacked once for MT activation rows (RB * MT accumulators, in registers) */
#if defined(__AVX512BW__)
#define WIDE 1 /* two groups per 64-byte register */
#define RB 4
#define MT 4
#elif defined(__aarch64__)
#define WIDE 0 /* q4_neon.h: a group a step */
#define RB 4
#define MT 2
#else
#define WIDE 0
#define RB 4
#define MT 2
#endif
/* AVX2 builds hold EXACT's two terms as one int16 x = 128 a + b (|x| <= 16320) and multiply with _mm256_madd_epi16:
 * the same exact int32 sums in 3 instructions a group where the two int8 terms took 6 (maddubs, madd, for each,
 * and the shift and add), and weights widen from 16 bytes to int16 in 3. The AVX-512 builds keep the two terms. */
#if defined(__aarch64__)
#define X16 0 /* NEON builds keep EXACT's two int8 terms (q4_neon.h) */
#else
#define X16 (!WIDE)
#endif

#include "cpu_ok.h" /* prima_cpu_ok: build.py loads a build only where this CPU runs it */

/* Where value j of a group pair's 64 bytes goes: the order the wide path unpacks weights in ([g 0-15, g+1 0-15,
 * g 16-31, g+1 16-31]); the natural order for the last group of an odd count and for AVX2. */
static inline int64_t slot(int64_t g, int j, int64_t groups, int natural) {
    if (!WIDE || natural || (g | 1) >= groups) return g * GROUP + j;
    return (g & ~1) * GROUP + (j >> 4) * 32 + (g & 1) * 16 + (j & 15);
}

#if X16
#include "q4_x16.h" /* quantize_row_x16 */
#endif

/* One activation row x [K] -> int8 terms a (and b in EXACT; X16 builds: x16 = 128 a + b in the natural order
 * instead, 8 lanes at a time) in slot order (or the natural one), each group's scale and sum. wide16: Q8's terms
 * as int16 x16 too (the tiled int8 kernel of AVX2 builds reads int16 in either mode; the tiled int4 one int8 Q8). */
static void quantize_row(const float *x, int8_t *a, int8_t *b, int16_t *x16, float *scale, float *sums, int64_t k,
                         int mode, int natural, int wide16) {
#if X16
    if (mode == EXACT) {
        quantize_row_x16(x, x16, scale, sums, k); /* q4_x16.h */
        return;
    }
#endif
    const int64_t groups = k / GROUP;
    for (int64_t g = 0; g < groups; g++) {
        const float *v = x + g * GROUP;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
            sum += v[j];
        }
        if (mode == Q8) {
#if defined(__aarch64__) /* fcvt rounds to nearest even, as _cvtss_sh(, 0) */
            const float d = (float)(__fp16)(amax / 127.0f), id = amax != 0.0f ? 127.0f / amax : 0.0f;
#else
            const float d = _cvtsh_ss(_cvtss_sh(amax / 127.0f, 0)), id = amax != 0.0f ? 127.0f / amax : 0.0f;
#endif
            int isum = 0;
            for (int j = 0; j < GROUP; j++) {
                const int8_t q = (int8_t)nearbyintf(v[j] * id);
                if (wide16)
                    x16[g * GROUP + j] = q;
                else
                    a[slot(g, j, groups, natural)] = q;
                isum += q;
            }
            scale[g] = d;
            sums[g] = d * (float)isum;
        } else {
            int e = 0;
            frexpf(amax / 127.0f, &e); /* amax / 127 < 2^e */
            const float s = amax > 0.0f ? ldexpf(1.0f, e) : 1.0f;
            for (int j = 0; j < GROUP; j++) {
                const float hi = nearbyintf(v[j] / s), lo = nearbyintf((v[j] - hi * s) * (128.0f / s)); /* x - hi s: exact */
                a[slot(g, j, groups, natural)] = (int8_t)hi;
                b[slot(g, j, groups, natural)] = (int8_t)lo;
            }
            scale[g] = s / 128.0f;
            sums[g] = sum;
        }
    }
}

#if !defined(__aarch64__) /* x86's sums and dot products (NEON's: q4_neon.h) */
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

/* 8 int32: sums of 4 products of unsigned w and signed x bytes each. */
static inline __m256i dot256(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* The int32 dot of one group (8 lanes) for activation terms at a (and b, EXACT: 128 a + b). */
static inline __m256i group_dot(__m256i w, const int8_t *a, const int8_t *b, int mode) {
    const __m256i hi = dot256(w, _mm256_loadu_si256((const __m256i *)a));
    if (mode == Q8) return hi;
    return _mm256_add_epi32(_mm256_slli_epi32(hi, 7), dot256(w, _mm256_loadu_si256((const __m256i *)b)));
}
#endif

/* Per-row state of a call: activation rows' terms, scales and sums, each row's [K] or [G]. */
typedef struct {
    const int8_t *a, *b; /* X16 builds in EXACT: x16 instead, in a's allocation */
    const int16_t *x16;
    const float *scale, *sums;
    int64_t k, groups, mode;
} acts;

#if !defined(__aarch64__)
/* 32 unsigned weights of group g of a row, in the natural order. */
static inline __m256i unpack256(const uint8_t *qr, int64_t g) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(qr + g * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

#if WIDE
static inline __m512i dot512(__m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
#endif
}

/* The sum of each of 4 vectors' 16 lanes, as [a, b, c, d]: every vector in the same order whatever its place. */
static inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Float sums out[i][r] of weight rows rows[i] (i < RB) times activation rows [r0, r0 + mt) over group pairs. */
static inline void wide_tile(const uint8_t *const *qr, const uint16_t *const *dr, const acts *x, int64_t r0,
                             int64_t mt, float out[RB][MT]) {
    const int64_t pairs = x->groups / 2;
    /* lanes 0-3 and 8-11 hold group g, 4-7 and 12-15 group g + 1 (slot order) */
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i low = _mm256_set1_epi8(15);
    __m512 acc[RB][MT];
    for (int i = 0; i < RB; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm512_setzero_ps();
    __m512 d16[RB]; /* 16 groups' d of each weight row, converted once for 8 pairs */
    for (int i = 0; i < RB; i++) d16[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if ((p & 7) == 0) {
            const __mmask16 live = (__mmask16)(x->groups - 2 * p >= 16 ? 0xffff : (1u << (x->groups - 2 * p)) - 1);
            for (int i = 0; i < RB; i++) d16[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, dr[i] + 2 * p));
        }
        const __m512i at = _mm512_add_epi32(pick, _mm512_set1_epi32((int)(2 * (p & 7))));
        __m512i w[RB];
        __m512 dw[RB];
        for (int i = 0; i < RB; i++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qr[i] + p * 32));
            w[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, low)),
                                      _mm256_and_si256(_mm256_srli_epi16(raw, 4), low), 1);
            dw[i] = _mm512_permutexvar_ps(at, d16[i]);
        }
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const int64_t row = r0 + r, off = row * x->k + p * 64;
                const __m512i a = _mm512_loadu_si512(x->a + off);
                double spair;
                memcpy(&spair, x->scale + row * x->groups + 2 * p, 8);
                const __m512 ds = _mm512_permutexvar_ps(pick, _mm512_castpd_ps(_mm512_set1_pd(spair)));
                for (int i = 0; i < RB; i++) {
                    __m512i dot = dot512(w[i], a);
                    if (x->mode == EXACT)
                        dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 7), dot512(w[i], _mm512_loadu_si512(x->b + off)));
                    acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[i], ds), acc[i][r]);
                }
            }
        }
    }
    for (int r = 0; r < mt; r++) {
        float s[4];
        _mm_storeu_ps(s, hsum4x16(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
        for (int i = 0; i < RB; i++) out[i][r] = s[i];
    }
}
#endif

/* Float sums out[i][r] of groups [g0, G) in 8 lanes a group (the last group of an odd count). */
static inline void narrow_tile(const uint8_t *const *qr, const uint16_t *const *dr, const acts *x, int64_t r0,
                               int64_t mt, int64_t g0, float out[RB][MT]) {
    __m256 acc[RB][MT];
    for (int i = 0; i < RB; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t g = g0; g < x->groups; g++) {
        __m256i w[RB];
        float d[RB];
        for (int i = 0; i < RB; i++) {
            w[i] = unpack256(qr[i], g);
            d[i] = _cvtsh_ss(dr[i][g]);
        }
        for (int r = 0; r < mt && r < MT; r++) {
            const int64_t off = (r0 + r) * x->k + g * GROUP;
            const float sx = x->scale[(r0 + r) * x->groups + g];
            for (int i = 0; i < RB; i++) {
                const __m256i dot = group_dot(w[i], x->a + off, x->b + off, (int)x->mode);
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[i] * sx), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < RB; i++)
        for (int r = 0; r < mt && r < MT; r++) out[i][r] = hsum8(acc[i][r]);
}

/* Bytes [p, p + n) asked into the cache ahead of their use, a line at a time. A decode step reads every weight once
 * from memory; the hardware's prefetchers stop at each 4 KB page, so a tile's rows waited for memory: asking for the
 * rows two tiles ahead made a real AVX2 box's (Zen 3, 1 thread) SmolLM2 int4 layers 1.3x and its int8 output 1.6-1.75x
 * faster (python -m tools.bench.bench_stream). */
#define AHEAD_TILES 2
static inline void ahead(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}
#endif

/* The calling thread's buffer for a call's quantized activations, kept for its next call (a decode step makes ~120:
 * a malloc and free each cost as much as a small matmul's quantization); NULL out of memory. */
static void *scratch(size_t bytes) {
    static __thread void *held = NULL;
    static __thread size_t size = 0;
    if (bytes > size || held == NULL) { /* held NULL: a first call of no rows still gets a buffer */
        free(held);
        held = malloc(bytes > 0 ? bytes : 1);
        size = held == NULL ? 0 : bytes;
    }
    return held;
}

/* The activations of a call quantized into the thread's scratch buffer; -1 out of memory. X16 builds split a
 * prompt's rows over the threads (each row's terms are its own: the same bits); the others quantize on one. */
static int quantize(const float *x, int64_t m, int64_t k, int mode, int natural, int wide16, int threads, acts *xs) {
    const int64_t groups = k / GROUP, bytes = m * k * (mode == EXACT || wide16 ? 2 : 1);
    int8_t *a = scratch((size_t)bytes + (size_t)(m * groups * 2) * sizeof(float));
    if (a == NULL) return -1;
    float *f = (float *)(a + bytes);
    int16_t *x16 = (int16_t *)a;
    *xs = (acts){a, a + m * k, x16, f, f + m * groups, k, groups, mode};
#if X16
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m >= 16)
#endif
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, a + r * k, a + m * k + r * k, x16 + r * k, f + r * groups, f + m * groups + r * groups,
                     k, mode, natural, wide16);
    return 0;
}

#if defined(__aarch64__)
#include "q4_neon.h" /* prima_q4_tiles, prima_q4_mm and prima_int8_mm of NEON builds */
#else
#if WIDE /* the row layout's int4 matmul: AVX-512 builds (AVX2 ones tile, below) */
/* y [M, N] = x @ w.T for weight rows [row, row + RB) (those below N) and activation rows [r0, r0 + mt). */
static inline void rows_tile(const uint8_t *q, const uint16_t *dm, const acts *x, float *y, int64_t r0, int64_t mt,
                             int64_t n, int64_t row) {
    const int64_t groups = x->groups;
    const uint8_t *qr[RB];
    const uint16_t *dr[RB];
    for (int i = 0; i < RB; i++) { /* rows past N compute row N - 1 again, unstored */
        const int64_t at = row + i < n ? row + i : n - 1;
        qr[i] = q + at * (x->k / 2);
        dr[i] = dm + at * 2 * groups;
    }
    if (r0 == 0 && row + RB * (AHEAD_TILES + 1) <= n) {
        ahead(q + (row + RB * AHEAD_TILES) * (x->k / 2), RB * (x->k / 2));
        ahead(dm + (row + RB * AHEAD_TILES) * 2 * groups, RB * 2 * groups * (int64_t)sizeof(uint16_t));
    }
    float wide[RB][MT] = {{0}}, tail[RB][MT] = {{0}};
    wide_tile(qr, dr, x, r0, mt, wide);
    narrow_tile(qr, dr, x, r0, mt, groups & ~(int64_t)1, tail);
    for (int i = 0; i < RB && row + i < n; i++)
        for (int r = 0; r < mt; r++)
            y[(r0 + r) * n + row + i] = (wide[i][r] + tail[i][r]) + m_dot(dr[i] + groups, x->sums + (r0 + r) * groups,
                                                                           groups);
}

/* y [M, N] = x [M, K] @ w.T; mode EXACT or Q8 (the activations' quantization). Returns 0, or -1 out of memory. */
int prima_q4_mm(const uint8_t *q, const uint16_t *dm, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                int mode, int threads) {
    acts xs;
    if (quantize(x, m, k, mode, 0, 0, threads, &xs)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < n; row += RB)
        for (int64_t r0 = 0; r0 < m; r0 += MT) rows_tile(q, dm, &xs, y, r0, m - r0 < MT ? m - r0 : MT, n, row);
    return 0;
}
#endif

#if !WIDE
/* AVX2 builds keep int4 weights in tiles of TILE rows, one stream a tile: for each group, 128 bytes of values, then
 * the 8 rows' d, then their m (float16), so int32 lane j of a register is row j's. Chunk c's byte 2j + e holds row
 * j's value 2c + e (low nibble) and 16 + 2c + e (high): widened to int16, one _mm256_madd_epi16 with an activation
 * pair broadcast adds two products to each row's lane, and a group's sum is complete (exact, int32) in its lane, so
 * a group costs one float conversion and one fma for 8 rows where the row layout paid them once a row and summed the
 * lanes at the end. The rows' reads merge into one stream, which the prefetchers follow. */
#define TILE 8
#define TILE_BYTES (TILE * GROUP / 2 + 2 * TILE * 2) /* 160: 0.625 bytes a weight, as the row layout */
#define AHEAD_BYTES 1024
/* Activation rows a tile's unpacked weights meet at once: 2 below 4 rows (decode), else 4 (1.25x at 4-512 rows, 0.8x
 * at one). Each row's sums are its own, in one order, so the bits do not depend on which. */
#define MT_MAX 4

int prima_q4_tiles(void) { return TILE; }

/* tiles [ceil(N / TILE), G, TILE_BYTES] from q [N, K/2] (GGUF's order) and dm [N, 2, G]; rows past N are zeros. */
void prima_q4_tile(const uint8_t *q, const uint16_t *dm, uint8_t *tiles, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / GROUP, count = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < count; t++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *out = tiles + (t * groups + g) * TILE_BYTES;
            uint16_t *d = (uint16_t *)(out + TILE * GROUP / 2), *m = d + TILE;
            memset(out, 0, TILE_BYTES);
            for (int j = 0; j < TILE && t * TILE + j < n; j++) {
                const int64_t row = t * TILE + j;
                const uint8_t *src = q + row * (k / 2) + g * 16; /* byte i: value i low, 16 + i high */
                for (int c = 0; c < 8; c++)
                    for (int e = 0; e < 2; e++) out[16 * c + 2 * j + e] = src[2 * c + e];
                d[j] = dm[row * 2 * groups + g];
                m[j] = dm[row * 2 * groups + groups + g];
            }
        }
}

/* Group g's exact int32 sums S of a tile's 8 rows (lane j: row j) with activation rows [r0, r0 + mt), EXACT's
 * int16 terms x16 = 128 a + b: each 16-byte chunk widened to int16, one _mm256_madd_epi16 with a broadcast pair. */
static inline __attribute__((always_inline)) void group_sums_x16(const uint8_t *blk, const acts *x, int64_t r0,
                                                                 int64_t mt, int64_t g, const int at_once,
                                                                 __m256i *sum) {
    const __m256i low = _mm256_set1_epi16(15);
    for (int c = 0; c < 8; c++) {
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 * c)));
        const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_srli_epi16(w, 4);
        for (int r = 0; r < mt && r < at_once; r++) {
            const int16_t *xr = x->x16 + (r0 + r) * x->k + g * GROUP + 2 * c;
            int32_t pl, ph;
            memcpy(&pl, xr, 4);
            memcpy(&ph, xr + 16, 4);
            sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi32(pl)),
                                                               _mm256_madd_epi16(hi, _mm256_set1_epi32(ph))));
        }
    }
}

/* The same S for Q8's one int8 term a: the weight bytes meet the activations in _mm256_maddubs_epi16 (values 0-15 by
 * signed terms), 32 products an instruction where int16 madd takes 16, and the weights need no widening. A 32-byte
 * load holds chunks c and c + 1: int16 lane j of its low half is row j's pair 2c, of its high half row j's pair
 * 2c + 2, so the activation register broadcasts one pair to each half. A group's 8 maddubs sum in int16 (each at
 * most 2 * 15 * 127 = 3810 in magnitude, so 30480: exact), then its two halves in int32: the same S, so the same
 * bits (1.08x on SmolLM2's layer matmuls at one thread on a real AVX2 Zen 3; docs/performance.md, session 23). */
static inline __attribute__((always_inline)) void group_sums_q8(const uint8_t *blk, const acts *x, int64_t r0,
                                                                int64_t mt, int64_t g, const int at_once,
                                                                __m256i *sum) {
    const __m256i low = _mm256_set1_epi8(15);
    /* bytes (0, 1) repeated in the low half, (2, 3) in the high: a pair for each half from one 32-bit broadcast */
    const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256i s16[MT_MAX];
    for (int r = 0; r < at_once; r++) s16[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c += 2) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 16 * c));
        const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int r = 0; r < mt && r < at_once; r++) {
            const int8_t *ar = x->a + (r0 + r) * x->k + g * GROUP + 2 * c;
            int32_t pl, ph;
            memcpy(&pl, ar, 4);
            memcpy(&ph, ar + 16, 4);
            const __m256i al = _mm256_shuffle_epi8(_mm256_set1_epi32(pl), pairs),
                          ah = _mm256_shuffle_epi8(_mm256_set1_epi32(ph), pairs);
            s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, al),
                                                               _mm256_maddubs_epi16(hi, ah)));
        }
    }
    for (int r = 0; r < mt && r < at_once; r++)
        sum[r] = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[r])),
                                  _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[r], 1)));
}

/* y [M, N] for the TILE rows of tile t and activation rows [r0, r0 + mt): per row and output, sum over groups in
 * order of S d sx (S the group's exact int32 sum) and, apart, of m sum(x); their sum last: one order for any call. */
static inline __attribute__((always_inline)) void tiled_tile(const uint8_t *tiles, const acts *x, float *y, int64_t r0,
                                                             int64_t mt, int64_t n, int64_t t, const int at_once,
                                                             const int q8) { /* q8: x->mode == Q8, a constant */
    __m256 accd[MT_MAX], accm[MT_MAX];
    for (int r = 0; r < at_once; r++) accd[r] = accm[r] = _mm256_setzero_ps();
    const uint8_t *blk = tiles + t * x->groups * TILE_BYTES;
    for (int64_t g = 0; g < x->groups; g++, blk += TILE_BYTES) {
        if (r0 == 0)
            for (int o = 0; o < TILE_BYTES; o += 64) _mm_prefetch((const char *)blk + AHEAD_BYTES + o, _MM_HINT_T0);
        __m256i sum[MT_MAX];
        for (int r = 0; r < at_once; r++) sum[r] = _mm256_setzero_si256();
        if (q8)
            group_sums_q8(blk, x, r0, mt, g, at_once, sum);
        else
            group_sums_x16(blk, x, r0, mt, g, at_once, sum);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + TILE * GROUP / 2)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + TILE * GROUP / 2 + 2 * TILE)));
        for (int r = 0; r < mt && r < at_once; r++) {
            const int64_t at = (r0 + r) * x->groups + g;
            /* d sx is exact (11 by at most 11 significant bits) and S is below 2^24: one rounding, the fma's */
            accd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x->scale[at])),
                                      accd[r]);
            accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->sums[at]), accm[r]);
        }
    }
    for (int r = 0; r < mt && r < at_once; r++) {
        float out[TILE];
        _mm256_storeu_ps(out, _mm256_add_ps(accd[r], accm[r]));
        for (int j = 0; j < TILE && t * TILE + j < n; j++) y[(r0 + r) * n + t * TILE + j] = out[j];
    }
}

#include "q4_gemm_avx2.h" /* gemm_x16: EXACT's many rows (a prompt) */

/* y [M, N] = x [M, K] @ w.T for tiled weights (prima_q4_tile); as prima_q4_mm. */
int prima_q4_tiled_mm(const uint8_t *tiles, const float *x, float *y, int64_t m, int64_t n, int64_t k, int mode,
                      int threads) {
    acts xs;
    if (quantize(x, m, k, mode, 1, mode == EXACT, threads, &xs)) return -1; /* Q8: int8 terms for maddubs */
    if (mode == EXACT && m >= GEMM_ROWS) {
        gemm_x16(tiles, &xs, y, m, n, threads);
        return 0;
    }
    const int64_t step = m < MT_MAX ? 2 : MT_MAX;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < (n + TILE - 1) / TILE; t++)
        for (int64_t r0 = 0; r0 < m; r0 += step) {
            const int64_t mt = m - r0 < step ? m - r0 : step;
            if (step == 2 && mode == Q8)
                tiled_tile(tiles, &xs, y, r0, mt, n, t, 2, 1);
            else if (step == 2)
                tiled_tile(tiles, &xs, y, r0, mt, n, t, 2, 0);
            else if (mode == Q8)
                tiled_tile(tiles, &xs, y, r0, mt, n, t, MT_MAX, 1);
            else
                tiled_tile(tiles, &xs, y, r0, mt, n, t, MT_MAX, 0);
        }
    return 0;
}

/* int8 weights in tiles of TILE rows the same way: for each group, 16 chunks of 16 bytes, chunk c's byte 2j + e row
 * j's value 2c + e; the rows' scales apply once, at the end. tiles [ceil(N / TILE), G, TILE * GROUP]. */
void prima_int8_tile(const int8_t *w8, int8_t *tiles, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / GROUP, count = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < count; t++)
        for (int64_t g = 0; g < groups; g++) {
            int8_t *out = tiles + (t * groups + g) * TILE * GROUP;
            memset(out, 0, TILE * GROUP);
            for (int j = 0; j < TILE && t * TILE + j < n; j++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) out[16 * c + 2 * j + e] = w8[(t * TILE + j) * k + g * GROUP + 2 * c + e];
        }
}

/* y [M, N] for tile t's rows and activation rows [r0, r0 + mt): per output, sum over groups in order of S sx (S the
 * group's exact int32 sum), times the row's scale. */
static inline __attribute__((always_inline)) void int8_tiled_tile(const int8_t *tiles, const float *wscale,
                                                                  const acts *x, float *y, int64_t r0, int64_t mt,
                                                                  int64_t n, int64_t t, const int at_once) {
    __m256 acc[MT_MAX];
    for (int r = 0; r < at_once; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *blk = tiles + t * x->groups * TILE * GROUP;
    for (int64_t g = 0; g < x->groups; g++, blk += TILE * GROUP) {
        if (r0 == 0)
            for (int o = 0; o < TILE * GROUP; o += 64) _mm_prefetch((const char *)blk + AHEAD_BYTES + o, _MM_HINT_T0);
        __m256i sum[MT_MAX];
        for (int r = 0; r < at_once; r++) sum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 16; c++) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 * c)));
            for (int r = 0; r < mt && r < at_once; r++) {
                int32_t pair;
                memcpy(&pair, x->x16 + (r0 + r) * x->k + g * GROUP + 2 * c, 4);
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(w, _mm256_set1_epi32(pair)));
            }
        }
        for (int r = 0; r < mt && r < at_once; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(x->scale[(r0 + r) * x->groups + g]),
                                     acc[r]);
    }
    float sc[TILE] = {0};
    for (int j = 0; j < TILE && t * TILE + j < n; j++) sc[j] = wscale[t * TILE + j];
    for (int r = 0; r < mt && r < at_once; r++) {
        float out[TILE];
        _mm256_storeu_ps(out, _mm256_mul_ps(acc[r], _mm256_loadu_ps(sc)));
        for (int j = 0; j < TILE && t * TILE + j < n; j++) y[(r0 + r) * n + t * TILE + j] = out[j];
    }
}

/* y [M, N] = x [M, K] @ (w * wscale[:, None]).T for tiled int8 weights (prima_int8_tile); as prima_int8_mm. */
int prima_int8_tiled_mm(const int8_t *tiles, const float *wscale, const float *x, float *y, int64_t m, int64_t n,
                        int64_t k, int mode, int threads) {
    acts xs;
    if (quantize(x, m, k, mode, 1, 1, threads, &xs)) return -1;
    const int64_t step = m < MT_MAX ? 2 : MT_MAX;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < (n + TILE - 1) / TILE; t++)
        for (int64_t r0 = 0; r0 < m; r0 += step) {
            if (step == 2)
                int8_tiled_tile(tiles, wscale, &xs, y, r0, m - r0 < 2 ? m - r0 : 2, n, t, 2);
            else
                int8_tiled_tile(tiles, wscale, &xs, y, r0, m - r0 < MT_MAX ? m - r0 : MT_MAX, n, t, MT_MAX);
        }
    return 0;
}

/* out [r, k] = rows ids of tiled int8 weights (prima_int8_tile) times their row's scale, one float product each as
 * Int8Tiles.values(ids).float() * scale computes it: a tied embedding's lookups, one call where torch took ~8 ops
 * (0.29 ms a token at the head of a loopback ring, its caches cold). Returns -1, writing nothing, if an id is
 * outside [0, n). */
int prima_int8_tiled_rows(const int8_t *tiles, const float *wscale, const int64_t *ids, int64_t r, float *out,
                          int64_t n, int64_t k) {
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < r; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < r; i++) {
        const int64_t row = ids[i], j = row % TILE;
        const int8_t *blk = tiles + row / TILE * groups * TILE * GROUP;
        const float s = wscale[row];
        for (int64_t g = 0; g < groups; g++, blk += TILE * GROUP)
            for (int c = 0; c < 16; c++)
                for (int e = 0; e < 2; e++) out[i * k + g * GROUP + 2 * c + e] = (float)blk[16 * c + 2 * j + e] * s;
    }
    return 0;
}
#else
int prima_q4_tiles(void) { return 0; } /* AVX-512 builds: the row layout (two groups a 64-byte register) */
#endif

/* int8 weights (one scale a row, nodes/engine/quant.py Int8): y [M, N] for weight rows [row, row + RB) and
 * activation rows [r0, r0 + mt), 8 lanes a group; w signed, so |w| (unsigned) meets x with w's sign (llama.cpp's
 * Q8_0 x Q8_0 way): |w| |x| <= 127 * 127, so a pair sums in int16 without saturating. */
static inline void int8_tile(const int8_t *w8, const float *wscale, const acts *x, float *y, int64_t r0, int64_t mt,
                             int64_t n, int64_t row) {
    const int8_t *wr[RB];
    for (int i = 0; i < RB; i++) wr[i] = w8 + (row + i < n ? row + i : n - 1) * x->k; /* past N: row N-1, unstored */
    if (r0 == 0 && row + RB * (AHEAD_TILES + 1) <= n) ahead(w8 + (row + RB * AHEAD_TILES) * x->k, RB * x->k);
    __m256 acc[RB][MT];
    for (int i = 0; i < RB; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < x->groups; g++) {
        __m256i w[RB], u[RB];
        for (int i = 0; i < RB; i++) {
            w[i] = _mm256_loadu_si256((const __m256i *)(wr[i] + g * GROUP));
            u[i] = _mm256_abs_epi8(w[i]);
        }
        for (int r = 0; r < mt && r < MT; r++) {
            const int64_t off = (r0 + r) * x->k + g * GROUP;
            const __m256 sx = _mm256_set1_ps(x->scale[(r0 + r) * x->groups + g]);
            if (X16 && x->mode == EXACT) { /* int16 x16 against w widened to int16 */
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(x->x16 + off));
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(x->x16 + off + 16));
                for (int i = 0; i < RB; i++) {
                    const __m256i dot = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w[i])), xl),
                        _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(w[i], 1)), xh));
                    acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sx, acc[i][r]);
                }
                continue;
            }
            const __m256i a = _mm256_loadu_si256((const __m256i *)(x->a + off));
            for (int i = 0; i < RB; i++) {
                __m256i dot = dot256(u[i], _mm256_sign_epi8(a, w[i]));
                if (x->mode == EXACT)
                    dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 7), dot256(u[i], _mm256_sign_epi8(
                        _mm256_loadu_si256((const __m256i *)(x->b + off)), w[i])));
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sx, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < RB && row + i < n; i++)
        for (int r = 0; r < mt; r++) y[(r0 + r) * n + row + i] = hsum8(acc[i][r]) * wscale[row + i];
}

/* y [M, N] = x [M, K] @ (w8 * wscale[:, None]).T for int8 weights [N, K]; as prima_q4_mm. */
int prima_int8_mm(const int8_t *w8, const float *wscale, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                  int mode, int threads) {
    acts xs;
    if (quantize(x, m, k, mode, 1, 0, threads, &xs)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < n; row += RB)
        for (int64_t r0 = 0; r0 < m; r0 += MT) int8_tile(w8, wscale, &xs, y, r0, m - r0 < MT ? m - r0 : MT, n, row);
    return 0;
}
#endif

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
