/* q4.c's matmuls on aarch64 (NEON), included by q4.c after its activation quantization (quantize, acts, RB, MT).
 * "neon-dotprod" builds (-march=armv8.2-a+dotprod) take 16 int8 products a step with vdotq_s32, plain "neon" ones
 * with vmull_s8 (int16 products, exact: |w x| <= 128 * 128) and vpadalq_s16 (pairs summed into int32); a group's
 * int32 sum is exact either way, so the two builds give the same bits.
 *
 * Weights stay in the row layout (prima_q4_tiles() is 0: q4.py keeps q [N, K/2] and dm [N, 2, G] as AVX-512 builds
 * do): a dot product needs 4 consecutive values of one row in a 32-bit lane, which AVX2's tiles interleave by pairs.
 * Activations keep EXACT's two int8 terms (q4.c's quantize_row, natural order): the same quantized values as x86.
 * RB = 4 weight rows are read at once, and each group's 4 exact sums land in one register, lane i weight row i; from
 * there each output is summed as AVX2's tiles sum it (per group, in order: fma of S by d sx, and apart fma of m by
 * sum(x); their sum last), so NEON builds give AVX2's bits, whatever rows share the call or split across threads. */

_Static_assert(RB == 4, "a group's sums of RB weight rows fill one 4-lane register");

/* Bytes [p, p + n) asked into the cache ahead of their use (q4.c's ahead: the rows two tiles ahead). */
#define AHEAD_TILES 2
static inline void ahead(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

/* acc + 4 int32 lanes, each a sum of 4 of the 16 products w x (which lane sums which differs by build, the sum of
 * all lanes does not). */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, w, x);
#else
    return vpadalq_s16(vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(x))), vmull_high_s8(w, x));
#endif
}

/* The exact int32 sums of one group (32 values) of RB weight rows w (each two halves, values 0-15 and 16-31) with
 * activation row terms at a (and b, EXACT: 128 a + b): lane i weight row i's. */
static inline int32x4_t group_sums(const int8x16_t w[RB][2], const int8_t *a, const int8_t *b, int mode) {
    const int8x16_t a0 = vld1q_s8(a), a1 = vld1q_s8(a + 16);
    int32x4_t s[RB];
    for (int i = 0; i < RB; i++) s[i] = dot16(dot16(vdupq_n_s32(0), w[i][0], a0), w[i][1], a1);
    if (mode == EXACT) {
        const int8x16_t b0 = vld1q_s8(b), b1 = vld1q_s8(b + 16);
        for (int i = 0; i < RB; i++)
            s[i] = vaddq_s32(vshlq_n_s32(s[i], 7), dot16(dot16(vdupq_n_s32(0), w[i][0], b0), w[i][1], b1));
    }
    return vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]));
}

/* 4 float16 values (one per weight row) as float32, exactly. */
static inline float32x4_t halves(uint16_t h0, uint16_t h1, uint16_t h2, uint16_t h3) {
    const uint16_t h[4] = {h0, h1, h2, h3};
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
}

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
    const uint8x16_t low = vdupq_n_u8(15);
    float32x4_t accd[MT], accm[MT];
    for (int r = 0; r < MT; r++) accd[r] = accm[r] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        int8x16_t w[RB][2];
        for (int i = 0; i < RB; i++) { /* byte j: value j low, 16 + j high (GGUF's order) */
            const uint8x16_t raw = vld1q_u8(qr[i] + g * 16);
            w[i][0] = vreinterpretq_s8_u8(vandq_u8(raw, low));
            w[i][1] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
        }
        const float32x4_t d = halves(dr[0][g], dr[1][g], dr[2][g], dr[3][g]);
        const float32x4_t m = halves(dr[0][groups + g], dr[1][groups + g], dr[2][groups + g], dr[3][groups + g]);
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const int64_t off = (r0 + r) * x->k + g * GROUP, at = (r0 + r) * groups + g;
                const int32x4_t sum = group_sums(w, x->a + off, x->b + off, (int)x->mode);
                /* d sx is exact (11 by at most 11 significant bits) and S is below 2^24: one rounding, the fma's */
                accd[r] = vfmaq_f32(accd[r], vcvtq_f32_s32(sum), vmulq_f32(d, vdupq_n_f32(x->scale[at])));
                accm[r] = vfmaq_f32(accm[r], m, vdupq_n_f32(x->sums[at]));
            }
        }
    }
    for (int r = 0; r < mt; r++) {
        float out[RB];
        vst1q_f32(out, vaddq_f32(accd[r], accm[r]));
        for (int i = 0; i < RB && row + i < n; i++) y[(r0 + r) * n + row + i] = out[i];
    }
}

int prima_q4_tiles(void) { return 0; } /* NEON builds: the row layout (above) */

/* y [M, N] = x [M, K] @ w.T; mode EXACT or Q8 (the activations' quantization). Returns 0, or -1 out of memory. */
int prima_q4_mm(const uint8_t *q, const uint16_t *dm, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                int mode, int threads) {
    acts xs;
    if (quantize(x, m, k, mode, 1, 0, threads, &xs)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < n; row += RB)
        for (int64_t r0 = 0; r0 < m; r0 += MT) rows_tile(q, dm, &xs, y, r0, m - r0 < MT ? m - r0 : MT, n, row);
    return 0;
}

/* int8 weights (one scale a row): y [M, N] for weight rows [row, row + RB) and activation rows [r0, r0 + mt); per
 * output, sum over groups in order of S sx, times the row's scale (AVX2's int8 tiles' order). */
static inline void int8_tile(const int8_t *w8, const float *wscale, const acts *x, float *y, int64_t r0, int64_t mt,
                             int64_t n, int64_t row) {
    const int8_t *wr[RB];
    float sc[RB];
    for (int i = 0; i < RB; i++) { /* past N: row N-1, unstored */
        wr[i] = w8 + (row + i < n ? row + i : n - 1) * x->k;
        sc[i] = wscale[row + i < n ? row + i : n - 1];
    }
    if (r0 == 0 && row + RB * (AHEAD_TILES + 1) <= n) ahead(w8 + (row + RB * AHEAD_TILES) * x->k, RB * x->k);
    float32x4_t acc[MT];
    for (int r = 0; r < MT; r++) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < x->groups; g++) {
        int8x16_t w[RB][2];
        for (int i = 0; i < RB; i++) {
            w[i][0] = vld1q_s8(wr[i] + g * GROUP);
            w[i][1] = vld1q_s8(wr[i] + g * GROUP + 16);
        }
        for (int r = 0; r < MT; r++) {
            if (r < mt) {
                const int64_t off = (r0 + r) * x->k + g * GROUP;
                const int32x4_t sum = group_sums(w, x->a + off, x->b + off, (int)x->mode);
                acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(sum), vdupq_n_f32(x->scale[(r0 + r) * x->groups + g]));
            }
        }
    }
    for (int r = 0; r < mt; r++) {
        float out[RB];
        vst1q_f32(out, vmulq_f32(acc[r], vld1q_f32(sc)));
        for (int i = 0; i < RB && row + i < n; i++) y[(r0 + r) * n + row + i] = out[i];
    }
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
