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
 * gu [rows, w_gate_up.n] = rms_norm(h, ffn_norm) @ w_gate_up.T. bqkv, q_norm, k_norm and post_attn_norm may be
 * NULL. Returns 0, or -1 out of memory (a kernel's, or its own scratch). */
int prima_attention_block(const float *x, float *h, float *gu, int64_t rows, int64_t hidden, const float *attn_norm,
                          const float *bqkv, const float *q_norm, const float *k_norm, const prima_matrix *wqkv,
                          const prima_matrix *wo,
                          const float *post_attn_norm, const float *ffn_norm, const prima_matrix *w_gate_up,
                          const prima_segment *segs, int64_t nseg, const float *cos, const float *sin, int64_t rot,
                          int64_t nh, int64_t nkv, int64_t hd, int64_t window, float scale, float eps, int threads) {
    const int64_t width = wqkv->n, att_width = nh * hd;
    float *xn = malloc((size_t)rows * (size_t)(hidden + width + att_width) * sizeof(float));
    if (xn == NULL) return -1;
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
    free(xn);
    return failed ? -1 : 0;
}

/* out [rows, H] = h + (a @ w_down.T, post_ffn_norm applied where given: may be NULL). Returns 0, or -1. */
int prima_down_block(const float *h, const float *a, float *out, int64_t rows, const prima_matrix *w_down,
                     const float *post_ffn_norm, float eps, int threads) {
    if (matmul(w_down, a, out, rows, threads)) return -1;
    if (post_ffn_norm != NULL) prima_rms_norm(out, post_ffn_norm, out, rows, w_down->n, eps);
    add_rows(out, h, rows, w_down->n, 0);
    return 0;
}
