/* q4.c's int4 matmul of many activation rows (a prompt) on AVX2 builds, included by q4.c after its tiled kernel
 * (tiled_tile, TILE, TILE_BYTES, MT_MAX). The tiled kernel meets a tile's 8 weight rows with 2 or 4 activation rows
 * behind bounds checks in its inner loops, their m sums in the same loop; here GEMM_ROWS rows at once, a constant,
 * every loop unrolled, the m sums in a pass of their own, so a group's int32 and float sums stay in registers; and
 * activation rows in blocks of GEMM_BLOCK that stay in L2 while every tile of the
 * thread passes over them (the tiled loop read each tile's 512 rows of a prompt from L3 again). SmolLM2's four layer
 * matmuls at 512 rows, one thread on the Zen 3 box, CPU time: 52.5 -> 37.2 ms (1.41x; the blocks ~4 % of it).
 *
 * Each output's sum is the tiled kernel's, op for op: per group in order, the exact int32 sum S (any order of exact
 * integer adds gives the same S), then accd = fma(S, d sx, accd); apart accm = fma(m, sum(x), accm) in group order;
 * accd + accm last. So a row's bits are those of a one-row call (tests/test_kernels.py). */

#define GEMM_ROWS 4 /* activation rows a step: 4 int32 and 4 float sums, a tile's weights and broadcasts fit 16 ymm */
#define GEMM_BLOCK 64 /* activation rows a block: 64 x 1536 int16 (192 KB) sit in Zen 3's 512 KB L2 */

/* Rows [r0, r0 + GEMM_ROWS) of y [M, N] for tile t, EXACT's int16 activations x16. */
static inline __attribute__((always_inline)) void gemm_x16_step(const uint8_t *tiles, const acts *x, float *y,
                                                                int64_t r0, int64_t n, int64_t t) {
    const __m256i low = _mm256_set1_epi16(15);
    const uint8_t *blk = tiles + t * x->groups * TILE_BYTES;
    const int16_t *xr[GEMM_ROWS];
    for (int r = 0; r < GEMM_ROWS; r++) xr[r] = x->x16 + (r0 + r) * x->k;
    __m256 accd[GEMM_ROWS], accm[GEMM_ROWS];
    for (int r = 0; r < GEMM_ROWS; r++) accd[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < x->groups; g++, blk += TILE_BYTES) {
        __m256i sum[GEMM_ROWS];
        for (int r = 0; r < GEMM_ROWS; r++) sum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 * c)));
            const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_srli_epi16(w, 4);
            for (int r = 0; r < GEMM_ROWS; r++) {
                int32_t pl, ph;
                memcpy(&pl, xr[r] + g * GROUP + 2 * c, 4);
                memcpy(&ph, xr[r] + g * GROUP + 16 + 2 * c, 4);
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(lo, _mm256_set1_epi32(pl)));
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(hi, _mm256_set1_epi32(ph)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + TILE * GROUP / 2)));
        for (int r = 0; r < GEMM_ROWS; r++)
            accd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]),
                                      _mm256_mul_ps(d, _mm256_set1_ps(x->scale[(r0 + r) * x->groups + g])), accd[r]);
    }
    blk = tiles + t * x->groups * TILE_BYTES;
    for (int64_t g = 0; g < x->groups; g++, blk += TILE_BYTES) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + TILE * GROUP / 2 + 2 * TILE)));
        for (int r = 0; r < GEMM_ROWS; r++)
            accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->sums[(r0 + r) * x->groups + g]), accm[r]);
    }
    for (int r = 0; r < GEMM_ROWS; r++) {
        float out[TILE];
        _mm256_storeu_ps(out, _mm256_add_ps(accd[r], accm[r]));
        for (int j = 0; j < TILE && t * TILE + j < n; j++) y[(r0 + r) * n + t * TILE + j] = out[j];
    }
}

/* y [M, N] = x @ w.T for EXACT's activations xs (quantized), M >= GEMM_ROWS: whole steps here, the last M %
 * GEMM_ROWS rows by tiled_tile. Blocks of rows in turn, each block's tiles split over the threads as the tiled loop
 * splits them; schedule static gives a thread the same tiles in every block (so they stay in its cache, and no
 * thread waits for another between blocks: nowait), one fork a call. */
static void gemm_x16(const uint8_t *tiles, const acts *xs, float *y, int64_t m, int64_t n, int threads) {
    const int64_t count = (n + TILE - 1) / TILE, whole = m - m % GEMM_ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t b0 = 0; b0 < m; b0 += GEMM_BLOCK) {
        const int64_t b1 = b0 + GEMM_BLOCK < m ? b0 + GEMM_BLOCK : m;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < count; t++) {
            int64_t r0 = b0;
            for (; r0 + GEMM_ROWS <= b1 && r0 < whole; r0 += GEMM_ROWS) gemm_x16_step(tiles, xs, y, r0, n, t);
            for (; r0 < b1; r0 += MT_MAX) tiled_tile(tiles, xs, y, r0, b1 - r0, n, t, MT_MAX, 0);
        }
    }
}
