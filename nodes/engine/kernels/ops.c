/* A decoder layer's float32 steps between its matmuls, each one C call where torch takes 6-30 small ops (a decode
 * step of SmolLM2 ran ~1700 aten ops for 120 matmuls; on a real AVX2 box those ops took as long as the matmuls):
 * RMSNorm, and a segment's RoPE + KV cache write + one-row attention. Built like q4.c (nodes/engine/kernels/build.py)
 * with -ffp-contract=off, so every product and sum rounds as torch's elementwise ops do: RoPE's results, and hence
 * the cache's keys, equal torch's bit for bit (tests/test_ops.py). Sums (the norm's mean of squares, attention's dot
 * products and softmax) go in one fixed order per row, so a row's result does not depend on the other rows of its
 * call. aarch64 builds (NEON) sum dot products in AVX2's order, so the same bits. */
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_ok.h" /* prima_cpu_ok: build.py loads a build only where this CPU runs it */

/* out [rows, n] = w * (x * rsqrt(mean(x^2) + eps)) per row: the mean of squares summed in double, then as torch's
 * rms_norm (nodes/engine/model.py): x times the float32 rsqrt, rounded, times w. out may be x. */
void prima_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        double ss = 0.0;
        for (int64_t j = 0; j < n; j++) ss += (double)v[j] * v[j];
        const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        float *o = out + r * n;
        for (int64_t j = 0; j < n; j++) o[j] = w[j] * (v[j] * inv);
    }
}

/* Rotate-half RoPE of one head's first `rot` dims at a position's cos / sin rows (each [rot], the halves alike):
 * out = x * cos + rotate(x) * sin, rotate(x) = [-x2, x1]; dims past rot copied. out must not be x. */
static void rope_head(const float *x, const float *c, const float *s, float *out, int64_t hd, int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t j = 0; j < half; j++) out[j] = x[j] * c[j] + (-x[j + half]) * s[j];
    for (int64_t j = half; j < rot; j++) out[j] = x[j] * c[j] + x[j - half] * s[j];
    for (int64_t j = rot; j < hd; j++) out[j] = x[j];
}

/* q . k over hd values: 8 lanes of products summed in turn, then the lanes (one order for every call), the rest
 * one by one. */
#if defined(__aarch64__)
static inline float dot(const float *q, const float *k, int64_t hd) { /* AVX2's below: its 8 lanes as lo, hi */
    float32x4_t lo = vdupq_n_f32(0.0f), hi = vdupq_n_f32(0.0f);
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) {
        lo = vfmaq_f32(lo, vld1q_f32(q + d), vld1q_f32(k + d));
        hi = vfmaq_f32(hi, vld1q_f32(q + d + 4), vld1q_f32(k + d + 4));
    }
    const float32x4_t s = vaddq_f32(lo, hi);
    const float32x2_t h = vadd_f32(vget_low_f32(s), vget_high_f32(s)); /* lanes 0 + 2, 1 + 3 */
    float sum = vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
    for (; d < hd; d++) sum = fmaf(q[d], k[d], sum);
    return sum;
}
#else
static inline float dot(const float *q, const float *k, int64_t hd) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for (; d < hd; d++) sum = fmaf(q[d], k[d], sum);
    return sum;
}
#endif

/* A head's hd values through its per-head RMSNorm (Qwen3's, Gemma 3's q_norm / k_norm) into tmp, or as they are where
 * the model has none (w NULL). */
static inline const float *head_norm(const float *x, const float *w, float *tmp, int64_t hd, float eps) {
    if (w == NULL) return x;
    prima_rms_norm(x, w, tmp, 1, hd, eps);
    return tmp;
}

/* One segment's attention for rows at positions [pos, pos + t): qkv [t, (nh + 2 nkv) hd] (q heads, k heads, v heads),
 * cos / sin [>= pos + t, rot]; kv [2, nkv, cap, hd] (keys, values) gets each row's rotated key and its value at its
 * position, then row i attends over keys [lo_i, pos + i] (lo_i = pos + i + 1 - window, >= 0; window 0: all), query
 * head h over key head h / (nh / nkv), softmax(q k * scale) v, into out [t, nh hd]. q_norm, k_norm [hd]: per-head
 * RMSNorms before RoPE, NULL where the model has none. Returns -1 out of memory. */
int prima_attend_rows(const float *qkv, const float *cos, const float *sin, float *kv, float *out, int64_t t,
                      int64_t pos, int64_t nh, int64_t nkv, int64_t hd, int64_t rot, int64_t cap, int64_t window,
                      float scale, const float *q_norm, const float *k_norm, float eps, int threads) {
    const int64_t width = (nh + 2 * nkv) * hd, group = nh / nkv;
    float *keys = kv, *values = kv + nkv * cap * hd;
    float normed[k_norm != NULL ? hd : 1]; /* a key head's norm, where the model has one: no malloc a call */
    for (int64_t i = 0; i < t; i++) {
        const float *row = qkv + i * width, *c = cos + (pos + i) * rot, *s = sin + (pos + i) * rot;
        for (int64_t h = 0; h < nkv; h++) {
            rope_head(head_norm(row + (nh + h) * hd, k_norm, normed, hd, eps), c, s, keys + (h * cap + pos + i) * hd,
                      hd, rot);
            const float *v = row + (nh + nkv + h) * hd;
            float *dst = values + (h * cap + pos + i) * hd;
            for (int64_t j = 0; j < hd; j++) dst[j] = v[j];
        }
    }
    const int64_t span = pos + t;
    float *scratch = malloc((size_t)(nh * t) * (size_t)(span + 2 * hd) * sizeof(float));
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (nh * t * span * hd > (1 << 18))
    for (int64_t job = 0; job < nh * t; job++) {
        const int64_t i = job / nh, h = job % nh, kh = h / group, at = pos + i;
        const int64_t lo = window > 0 && at + 1 - window > 0 ? at + 1 - window : 0;
        float *q = scratch + job * (span + 2 * hd), *qn = q + hd, *p = qn + hd;
        const float *row = qkv + i * width;
        rope_head(head_norm(row + h * hd, q_norm, qn, hd, eps), cos + at * rot, sin + at * rot, q, hd, rot);
        float top = -INFINITY;
        for (int64_t j = lo; j <= at; j++) {
            p[j] = dot(q, keys + (kh * cap + j) * hd, hd) * scale;
            top = p[j] > top ? p[j] : top;
        }
        float sum = 0.0f;
        for (int64_t j = lo; j <= at; j++) {
            p[j] = expf(p[j] - top);
            sum += p[j];
        }
        float *o = out + i * nh * hd + h * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
        for (int64_t j = lo; j <= at; j++) {
            const float *v = values + (kh * cap + j) * hd, pj = p[j] / sum;
            for (int64_t d = 0; d < hd; d++) o[d] += pj * v[d];
        }
    }
    free(scratch);
    return 0;
}

/* silu(g) = g / (1 + exp(-g)) as one fixed sequence of IEEE float32 operations, the same in every build (AVX2, NEON,
 * the scalar tail), so a row's MLP activation has the same bits on every path and ISA (libm's and Sleef's expf differ
 * between them). exp(-g) = 2^n p: n = round(-g log2 e), p = e^r on |r| <= ln2 / 2 (Cody-Waite r with fmas, Cephes'
 * expf polynomial); then g / (1 + 2^n p) = (g / (p + 2^-n)) 2^-n, which neither overflows for g very negative (n up to
 * 173: two power-of-two factors, the last rounding once into the subnormals) nor loses g very positive (n = -127:
 * (g / 2^127) 2^127 = g exactly). -g is clamped to [-88, 120] (past it 2^n p is below half an ulp of 1, or the result
 * below half the smallest subnormal) and g below -120 counts as -120 (so -inf gives -0.0); NaN gives g itself.
 * Within 2 ulp of the exact value over all of float32 (tests/test_silu.py). */
#define SILU_LO (-88.0f)      /* -g clamped to [SILU_LO, SILU_HI] */
#define SILU_HI 120.0f
#define SILU_G_LO (-120.0f)   /* g's floor */
#define SILU_MAGIC 0x1.8p23f  /* x + 1.5 2^23 - 1.5 2^23: x rounded to an integer, which the sum's low bits hold */
#define SILU_LOG2E 0x1.715476p+0f
#define SILU_LN2_HI 0x1.62e43p-1f
#define SILU_LN2_LO (-0x1.05c61p-29f)
#define SILU_P0 1.9875691500e-4f
#define SILU_P1 1.3981999507e-3f
#define SILU_P2 8.3334519073e-3f
#define SILU_P3 4.1665795894e-2f
#define SILU_P4 1.6666665459e-1f
#define SILU_P5 5.0000001201e-1f

static inline float from_bits(int32_t i) { union { int32_t i; float f; } u = {.i = i}; return u.f; }
static inline int32_t to_bits(float f) { union { float f; int32_t i; } u = {.f = f}; return u.i; }
static inline float pow2(int32_t e) { return from_bits((int32_t)((uint32_t)(e + 127) << 23)); } /* e in [-126, 127] */

/* The vector versions below do exactly these steps, in this order. (A > B ? A : B) is x86's max_ps(A, B). */
static inline float silu(float g) {
    float x = -g;
    x = SILU_LO > x ? SILU_LO : x;
    x = SILU_HI < x ? SILU_HI : x;
    const float s = x * SILU_LOG2E + SILU_MAGIC, nf = s - SILU_MAGIC;
    const int32_t m = to_bits(SILU_MAGIC) - to_bits(s); /* -n */
    float r = fmaf(nf, -SILU_LN2_HI, x);
    r = fmaf(nf, -SILU_LN2_LO, r);
    float p = fmaf(SILU_P0, r, SILU_P1);
    p = fmaf(p, r, SILU_P2), p = fmaf(p, r, SILU_P3), p = fmaf(p, r, SILU_P4), p = fmaf(p, r, SILU_P5);
    const float t = pow2(m > -126 ? m : -126), big = t > 1.0f ? t : 1.0f, small = t > 1.0f ? 1.0f : t;
    const float c_hi = big + small, c_lo = small - (c_hi - big); /* 1 + 2^-n, exactly */
    const float d = (fmaf(p, r * r, r) + c_lo) + c_hi;               /* (e^r - 1) + 1 + 2^-n */
    const int32_t a = m >> 1, b = m - a;
    const float gc = SILU_G_LO > g ? SILU_G_LO : g;
    const float q = gc / d * pow2(a) * pow2(b);
    return g != g ? g : q;
}

#if defined(__aarch64__)
static inline float32x4_t pow2x4(int32x4_t e) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(e, vdupq_n_s32(127)), 23));
}
static inline float32x4_t silu4(float32x4_t g) {
    const float32x4_t lo = vdupq_n_f32(SILU_LO), hi = vdupq_n_f32(SILU_HI), magic = vdupq_n_f32(SILU_MAGIC);
    const float32x4_t glo = vdupq_n_f32(SILU_G_LO);
    float32x4_t x = vnegq_f32(g);
    x = vbslq_f32(vcgtq_f32(lo, x), lo, x);
    x = vbslq_f32(vcltq_f32(hi, x), hi, x);
    const float32x4_t s = vaddq_f32(vmulq_f32(x, vdupq_n_f32(SILU_LOG2E)), magic), nf = vsubq_f32(s, magic);
    const int32x4_t m = vsubq_s32(vreinterpretq_s32_f32(magic), vreinterpretq_s32_f32(s));
    float32x4_t r = vfmaq_f32(x, nf, vdupq_n_f32(-SILU_LN2_HI));
    r = vfmaq_f32(r, nf, vdupq_n_f32(-SILU_LN2_LO));
    float32x4_t p = vfmaq_f32(vdupq_n_f32(SILU_P1), vdupq_n_f32(SILU_P0), r);
    p = vfmaq_f32(vdupq_n_f32(SILU_P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(SILU_P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(SILU_P4), p, r);
    p = vfmaq_f32(vdupq_n_f32(SILU_P5), p, r);
    const int32x4_t mt = vmaxq_s32(m, vdupq_n_s32(-126));
    const float32x4_t t = pow2x4(mt), one = vdupq_n_f32(1.0f);
    const uint32x4_t above = vcgtq_f32(t, one);
    const float32x4_t big = vbslq_f32(above, t, one), small = vbslq_f32(above, one, t);
    const float32x4_t c_hi = vaddq_f32(big, small), c_lo = vsubq_f32(small, vsubq_f32(c_hi, big));
    const float32x4_t d = vaddq_f32(vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), c_lo), c_hi);
    const int32x4_t a = vshrq_n_s32(m, 1), b = vsubq_s32(m, a);
    const float32x4_t gc = vbslq_f32(vcgtq_f32(glo, g), glo, g);
    float32x4_t q = vdivq_f32(gc, d);
    q = vmulq_f32(q, pow2x4(a));
    q = vmulq_f32(q, pow2x4(b));
    return vbslq_f32(vceqq_f32(g, g), q, g);
}
#define SILU_LANES 4
#define SILU_MUL_VEC(g, u, o) vst1q_f32(o, vmulq_f32(silu4(vld1q_f32(g)), vld1q_f32(u)))
#else
static inline __m256 pow2x8(__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}
static inline __m256 silu8(__m256 g) {
    const __m256 lo = _mm256_set1_ps(SILU_LO), hi = _mm256_set1_ps(SILU_HI), magic = _mm256_set1_ps(SILU_MAGIC);
    __m256 x = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
    x = _mm256_max_ps(lo, x);
    x = _mm256_min_ps(hi, x);
    const __m256 s = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(SILU_LOG2E)), magic), nf = _mm256_sub_ps(s, magic);
    const __m256i m = _mm256_sub_epi32(_mm256_castps_si256(magic), _mm256_castps_si256(s));
    __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-SILU_LN2_HI), x);
    r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-SILU_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(SILU_P0), r, _mm256_set1_ps(SILU_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SILU_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SILU_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SILU_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SILU_P5));
    const __m256i mt = _mm256_max_epi32(m, _mm256_set1_epi32(-126));
    const __m256 t = pow2x8(mt), one = _mm256_set1_ps(1.0f);
    const __m256 above = _mm256_cmp_ps(t, one, _CMP_GT_OQ);
    const __m256 big = _mm256_blendv_ps(one, t, above), small = _mm256_blendv_ps(t, one, above);
    const __m256 c_hi = _mm256_add_ps(big, small), c_lo = _mm256_sub_ps(small, _mm256_sub_ps(c_hi, big));
    const __m256 d = _mm256_add_ps(_mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), c_lo), c_hi);
    const __m256i a = _mm256_srai_epi32(m, 1), b = _mm256_sub_epi32(m, a);
    const __m256 gc = _mm256_max_ps(_mm256_set1_ps(SILU_G_LO), g);
    __m256 q = _mm256_div_ps(gc, d);
    q = _mm256_mul_ps(q, pow2x8(a));
    q = _mm256_mul_ps(q, pow2x8(b));
    return _mm256_blendv_ps(q, g, _mm256_cmp_ps(g, g, _CMP_UNORD_Q));
}
#define SILU_LANES 8
#define SILU_MUL_VEC(g, u, o) _mm256_storeu_ps(o, _mm256_mul_ps(silu8(_mm256_loadu_ps(g)), _mm256_loadu_ps(u)))
#endif

/* out [rows, I] = silu(gu[:, :I]) * gu[:, I:] of gu [rows, 2 I] (gate_up's product: gate, then up). */
void prima_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter > (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t j = 0;
        for (; j + SILU_LANES <= inter; j += SILU_LANES) SILU_MUL_VEC(g + j, u + j, o + j);
        for (; j < inter; j++) o[j] = silu(g[j]) * u[j];
    }
}

/* A decode step's layer as two calls where it took ~15 Python-level steps (SmolLM2 int4 on an AVX-512 Xeon: 13-16 us
 * a layer saved, 5-10 % of a decode; docs/performance.md): prima_attention_block from the layer's input to its MLP's
 * gate_up product, then, after the activation (torch's, in Python), prima_down_block to the layer's output. Each
 * step is the very function the unfused path (nodes/engine/model.py) runs, in its order, so the two give the same
 * bits. A matrix is one of the matmul kernels of q4.c / f32.c, found through ctypes and passed as its address with
 * its operands. */
enum { MM_F32 = 0, MM_ONE = 1, MM_TWO = 2, MM_ROWS = 3 }; /* f32.c's (w); q4.c's tiles (tiles); q4.c's with two
                                                               * operands; row ranges of their own kernels */

typedef struct {
    void *fn;
    const void *a, *b;
    int64_t n, k;
    int32_t kind, mode;
} prima_matrix;

typedef struct {
    float *kv; /* [2, nkv, cap, hd] */
    int64_t pos, t, cap;
} prima_segment;

typedef void (*mm_f32)(const void *, const float *, float *, int64_t, int64_t, int64_t, int);
typedef int (*mm_one)(const void *, const float *, float *, int64_t, int64_t, int64_t, int, int);
typedef int (*mm_two)(const void *, const void *, const float *, float *, int64_t, int64_t, int64_t, int, int);

static int matmul(const prima_matrix *w, const float *x, float *y, int64_t m, int threads);

/* y [m, w.n] = x @ w.T for a matrix of `mode` row-range pieces (a: prima_matrix[mode], stacked by rows), each
 * through its own kernel into scratch, then into its columns of y: a row's result is its piece's kernel's, as
 * quant.Rows computes it (torch.cat of each piece's product). */
static int rows_matmul(const prima_matrix *w, const float *x, float *y, int64_t m, int threads) {
    const prima_matrix *pieces = w->a;
    int64_t widest = 0;
    for (int32_t i = 0; i < w->mode; i++) widest = pieces[i].n > widest ? pieces[i].n : widest;
    float *part = malloc((size_t)m * (size_t)widest * sizeof(float));
    if (part == NULL) return -1;
    int failed = 0;
    for (int64_t i = 0, col = 0; !failed && i < w->mode; col += pieces[i].n, i++) {
        const int64_t n = pieces[i].n;
        failed = matmul(&pieces[i], x, part, m, threads);
        for (int64_t r = 0; !failed && r < m; r++)
            for (int64_t j = 0; j < n; j++) y[r * w->n + col + j] = part[r * n + j];
    }
    free(part);
    return failed ? -1 : 0;
}

static int matmul(const prima_matrix *w, const float *x, float *y, int64_t m, int threads) {
    switch (w->kind) {
    case MM_F32: ((mm_f32)w->fn)(w->a, x, y, m, w->n, w->k, threads); return 0;
    case MM_ONE: return ((mm_one)w->fn)(w->a, x, y, m, w->n, w->k, w->mode, threads);
    case MM_ROWS: return rows_matmul(w, x, y, m, threads);
    default: return ((mm_two)w->fn)(w->a, w->b, x, y, m, w->n, w->k, w->mode, threads);
    }
}

/* y [rows, n] = x + y elementwise, as torch's add (one rounding each); x is one row [n] for all where broadcast (a
 * bias). */
static void add_rows(float *y, const float *x, int64_t rows, int64_t n, int broadcast) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) y[r * n + j] = x[(broadcast ? 0 : r * n) + j] + y[r * n + j];
}

/* x [rows, H] (the segments' rows in order) -> h = x + attention (post_attn_norm applied where given) and
 * gu [rows, w_gate_up.n] = rms_norm(h, ffn_norm) @ w_gate_up.T, in scratch xn [rows, H + wqkv.n + nh hd]. bqkv, q_norm,
 * k_norm and post_attn_norm may be NULL. Returns 0, or -1 out of memory (a kernel's). */
static int attention_block(const float *x, float *h, float *gu, float *xn, int64_t rows, int64_t hidden,
                           const float *attn_norm, const float *bqkv, const float *q_norm, const float *k_norm,
                           const prima_matrix *wqkv, const prima_matrix *wo, const float *post_attn_norm,
                           const float *ffn_norm, const prima_matrix *w_gate_up, const prima_segment *segs,
                           int64_t nseg, const float *cos, const float *sin, int64_t rot, int64_t nh, int64_t nkv,
                           int64_t hd, int64_t window, float scale, float eps, int threads) {
    const int64_t width = wqkv->n, att_width = nh * hd;
    float *qkv = xn + rows * hidden, *att = qkv + rows * width;
    int failed = 0;
    prima_rms_norm(x, attn_norm, xn, rows, hidden, eps);
    failed = matmul(wqkv, xn, qkv, rows, threads);
    if (!failed && bqkv != NULL) add_rows(qkv, bqkv, rows, width, 1);
    for (int64_t s = 0, at = 0; !failed && s < nseg; at += segs[s].t, s++)
        failed = prima_attend_rows(qkv + at * width, cos, sin, segs[s].kv, att + at * att_width, segs[s].t,
                                   segs[s].pos, nh, nkv, hd, rot, segs[s].cap, window, scale, q_norm, k_norm, eps,
                                   threads);
    if (!failed) failed = matmul(wo, att, h, rows, threads);
    if (!failed) {
        if (post_attn_norm != NULL) prima_rms_norm(h, post_attn_norm, h, rows, hidden, eps);
        add_rows(h, x, rows, hidden, 0);
        prima_rms_norm(h, ffn_norm, xn, rows, hidden, eps);
        failed = matmul(w_gate_up, xn, gu, rows, threads);
    }
    return failed ? -1 : 0;
}

/* attention_block with scratch of its own. */
int prima_attention_block(const float *x, float *h, float *gu, int64_t rows, int64_t hidden, const float *attn_norm,
                          const float *bqkv, const float *q_norm, const float *k_norm, const prima_matrix *wqkv,
                          const prima_matrix *wo,
                          const float *post_attn_norm, const float *ffn_norm, const prima_matrix *w_gate_up,
                          const prima_segment *segs, int64_t nseg, const float *cos, const float *sin, int64_t rot,
                          int64_t nh, int64_t nkv, int64_t hd, int64_t window, float scale, float eps, int threads) {
    float *xn = malloc((size_t)rows * (size_t)(hidden + wqkv->n + nh * hd) * sizeof(float));
    if (xn == NULL) return -1;
    const int failed = attention_block(x, h, gu, xn, rows, hidden, attn_norm, bqkv, q_norm, k_norm, wqkv, wo,
                                       post_attn_norm, ffn_norm, w_gate_up, segs, nseg, cos, sin, rot, nh, nkv, hd,
                                       window, scale, eps, threads);
    free(xn);
    return failed;
}

/* out [rows, H] = h + (a @ w_down.T, post_ffn_norm applied where given: may be NULL). Returns 0, or -1. */
int prima_down_block(const float *h, const float *a, float *out, int64_t rows, const prima_matrix *w_down,
                     const float *post_ffn_norm, float eps, int threads) {
    if (matmul(w_down, a, out, rows, threads)) return -1;
    if (post_ffn_norm != NULL) prima_rms_norm(out, post_ffn_norm, out, rows, w_down->n, eps);
    add_rows(out, h, rows, w_down->n, 0);
    return 0;
}

/* A decode step through a run of consecutive layers as one call (nodes/engine/window_calls.py): each layer's
 * attention_block, silu_mul and down_block, the very steps of the two calls above with silu between them, so the
 * same bits. What a layer keeps from call to call is a prima_layer (built once in Python); a call brings the rows,
 * each segment's (pos, t) and, per segment, its KV tensors of these layers. */
typedef struct {
    prima_matrix wqkv, wo, w_gate_up, w_down;
    const float *attn_norm, *bqkv, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* NULL: none */
    const float *cos, *sin; /* its rope's [S, rot] */
    int64_t rot, window;    /* window 0: every earlier position */
} prima_layer;

typedef struct {
    float *kv; /* [2, nkv, cap, hd] */
    int64_t cap;
} prima_kv;

/* x [rows, H] -> out [rows, H] after layers[0 .. nlayers): spans [nseg, 2] each segment's (pos, t), in row order;
 * kvs[s][l] segment s's cache of layers[l]. x and out may not overlap. Returns 0, or -1 out of memory. */
int prima_window(const float *x, float *out, int64_t rows, int64_t hidden, const prima_layer *layers,
                 int64_t nlayers, const int64_t *spans, const prima_kv *const *kvs, int64_t nseg, int64_t nh,
                 int64_t nkv, int64_t hd, float scale, float eps, int threads) {
    int64_t width = 0, gate_up = 0;
    for (int64_t l = 0; l < nlayers; l++) {
        width = layers[l].wqkv.n > width ? layers[l].wqkv.n : width;
        gate_up = layers[l].w_gate_up.n > gate_up ? layers[l].w_gate_up.n : gate_up;
    }
    /* scratch: h [rows, H], gu [rows, 2 I], a [rows, I], attention_block's [rows, H + width + nh hd] */
    float *h = malloc((size_t)rows * (size_t)(2 * hidden + gate_up + gate_up / 2 + width + nh * hd) * sizeof(float));
    prima_segment *segs = malloc((size_t)(nseg > 0 ? nseg : 1) * sizeof(prima_segment));
    if (h == NULL || segs == NULL) return free(h), free(segs), -1;
    float *gu = h + rows * hidden, *a = gu + rows * gate_up, *xn = a + rows * (gate_up / 2);
    int failed = 0;
    for (int64_t l = 0; !failed && l < nlayers; l++) {
        const prima_layer *w = &layers[l];
        for (int64_t s = 0; s < nseg; s++)
            segs[s] = (prima_segment){kvs[s][l].kv, spans[2 * s], spans[2 * s + 1], kvs[s][l].cap};
        /* the first layer reads x, every layer writes out: a layer's input is spent once h holds it */
        failed = attention_block(l == 0 ? x : out, h, gu, xn, rows, hidden, w->attn_norm, w->bqkv, w->q_norm,
                                 w->k_norm, &w->wqkv, &w->wo, w->post_attn_norm, w->ffn_norm, &w->w_gate_up, segs,
                                 nseg, w->cos, w->sin, w->rot, nh, nkv, hd, w->window, scale, eps, threads);
        if (failed) break;
        prima_silu_mul(gu, a, rows, w->w_gate_up.n / 2, threads);
        failed = prima_down_block(h, a, out, rows, &w->w_down, w->post_ffn_norm, eps, threads);
    }
    free(h), free(segs);
    return failed ? -1 : 0;
}
