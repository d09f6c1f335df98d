/* q4.c's int4 matmul of many activation rows (a prompt) on AVX2 builds, included by q4.c after its tiled kernel
 * (tiled_tile, TILE, TILE_BYTES, MT_MAX). The tiled kernel meets a tile's 8 weight rows with 2 or 4 activation rows
 * behind bounds checks in its inner loops, their m sums in the same loop; here GEMM_ROWS rows at once, a constant,
 * two tiles sharing each activation broadcast (1.06x over one), every loop unrolled, the m sums in a pass of their
 * own, so a group's int32 sums stay in registers; and activation rows in blocks of GEMM_BLOCK that stay in L2 while
 * every tile of the thread passes over them (the tiled loop read each tile's 512 rows of a prompt from L3 again).
 * SmolLM2's four layer matmuls at 512 rows, one thread on the Zen 3 box, CPU time: 52.5 -> 35 ms (1.5x; the blocks
 * ~4 % of it).
 *
 * Each output's sum is the tiled kernel's, op for op: per group in order, the exact int32 sum S (any order of exact
 * integer adds gives the same S), then accd = fma(S, d sx, accd); apart accm = fma(m, sum(x), accm) in group order;
 * accd + accm last. So a row's bits are those of a one-row call (tests/test_kernels.py). */

#define GEMM_ROWS 4 /* a step: 2 tiles' 8 int32 sums, 4 weight registers, 2 broadcasts (2 x 3 rows: no faster) */
#define GEMM_BLOCK 64 /* activation rows a block: 64 x 1536 int16 (192 KB) sit in Zen 3's 512 KB L2 */

/* Rows [r0, r0 + GEMM_ROWS) of y [M, N] for tiles [t, t + nt) (nt 1 or 2, a constant: two tiles share each
 * activation broadcast), EXACT's int16 activations x16. */
static inline __attribute__((always_inline)) void gemm_x16_step(const uint8_t *tiles, const acts *x, float *y,
                                                                int64_t r0, int64_t n, int64_t t, const int nt) {
    const __m256i low = _mm256_set1_epi16(15);
    const int64_t stride = x->groups * TILE_BYTES; /* a tile's bytes */
    const uint8_t *blk = tiles + t * stride;
    const int16_t *xr[GEMM_ROWS];
    for (int r = 0; r < GEMM_ROWS; r++) xr[r] = x->x16 + (r0 + r) * x->k;
    __m256 accd[2][GEMM_ROWS], accm[2][GEMM_ROWS];
    for (int i = 0; i < nt; i++)
        for (int r = 0; r < GEMM_ROWS; r++) accd[i][r] = accm[i][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < x->groups; g++, blk += TILE_BYTES) {
        __m256i sum[2][GEMM_ROWS];
        for (int i = 0; i < nt; i++)
            for (int r = 0; r < GEMM_ROWS; r++) sum[i][r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            __m256i lo[2], hi[2];
            for (int i = 0; i < nt; i++) {
                const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + i * stride + 16 * c)));
                lo[i] = _mm256_and_si256(w, low);
                hi[i] = _mm256_srli_epi16(w, 4);
            }
            for (int r = 0; r < GEMM_ROWS; r++) {
                int32_t pl, ph;
                memcpy(&pl, xr[r] + g * GROUP + 2 * c, 4);
                memcpy(&ph, xr[r] + g * GROUP + 16 + 2 * c, 4);
                const __m256i al = _mm256_set1_epi32(pl), ah = _mm256_set1_epi32(ph);
                for (int i = 0; i < nt; i++) {
                    sum[i][r] = _mm256_add_epi32(sum[i][r], _mm256_madd_epi16(lo[i], al));
                    sum[i][r] = _mm256_add_epi32(sum[i][r], _mm256_madd_epi16(hi[i], ah));
                }
            }
        }
        for (int i = 0; i < nt; i++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + i * stride + TILE * GROUP / 2)));
            for (int r = 0; r < GEMM_ROWS; r++)
                accd[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][r]),
                                             _mm256_mul_ps(d, _mm256_set1_ps(x->scale[(r0 + r) * x->groups + g])),
                                             accd[i][r]);
        }
    }
    blk = tiles + t * stride;
    for (int64_t g = 0; g < x->groups; g++, blk += TILE_BYTES)
        for (int i = 0; i < nt; i++) {
            const __m256 m = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(blk + i * stride + TILE * GROUP / 2 + 2 * TILE)));
            for (int r = 0; r < GEMM_ROWS; r++)
                accm[i][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->sums[(r0 + r) * x->groups + g]), accm[i][r]);
        }
    for (int i = 0; i < nt; i++)
        for (int r = 0; r < GEMM_ROWS; r++) {
            float out[TILE];
            _mm256_storeu_ps(out, _mm256_add_ps(accd[i][r], accm[i][r]));
            for (int j = 0; j < TILE && (t + i) * TILE + j < n; j++) y[(r0 + r) * n + (t + i) * TILE + j] = out[j];
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
        for (int64_t p = 0; p < (count + 1) / 2; p++) { /* tiles 2p and 2p + 1 (where there is one) */
            const int64_t t = 2 * p;
            int64_t r0 = b0;
            for (; r0 + GEMM_ROWS <= b1 && r0 < whole; r0 += GEMM_ROWS) {
                if (t + 1 < count)
                    gemm_x16_step(tiles, xs, y, r0, n, t, 2);
                else
                    gemm_x16_step(tiles, xs, y, r0, n, t, 1);
            }
            for (; r0 < b1; r0 += MT_MAX)
                for (int64_t u = t; u < t + 2 && u < count; u++) tiled_tile(tiles, xs, y, r0, b1 - r0, n, u, MT_MAX, 0);
        }
    }
}
