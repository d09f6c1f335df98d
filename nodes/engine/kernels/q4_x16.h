/* EXACT's activation terms on X16 builds (AVX2), included by q4.c before quantize_row, which calls it: a row's
 * int16 x16 = 128 a + b, each group's scale s / 128 and sum, the very values of quantize_row's scalar loop, faster.
 * A 512-token prompt's rows took ~10 % of the int4 matmul's time here (3.5 ns a value, one thread, Zen 3): the sum
 * of a group is a chain of 32 dependent float adds and fmaxf is no single instruction. */

/* max |v[j]| of a group, as fmaxf(amax, fabsf(v[j])) from 0 gives it: a max is exact in any order, and max_ps(|v|,
 * m) keeps m where v is NaN, as fmaxf does. */
static inline float group_amax(const float *v) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + 8 * c), abs), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* 2^e for the e of frexpf(f, &e) (f < 2^e), as ldexpf(1, e): straight from f's exponent bits where f and the
 * result are normal floats, else through libm (each a call: two a group cost as much as its conversion). */
static inline float pow2_above(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t biased = (bits >> 23) & 0xff;
    if (biased >= 1 && biased <= 253) { /* f in [2^(b-127), 2^(b-126)): frexpf's e = b - 126 */
        const uint32_t out = (biased + 1) << 23;
        float s;
        memcpy(&s, &out, 4);
        return s;
    }
    int e = 0;
    frexpf(f, &e);
    return ldexpf(1.0f, e);
}

static void quantize_row_x16(const float *x, int16_t *x16, float *scale, float *sums, int64_t k) {
    const int64_t groups = k / GROUP;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) { /* 8 groups' sums side by side, each added in order j = 0..31 */
        float s[8] = {0};
        for (int j = 0; j < GROUP; j++)
            for (int i = 0; i < 8; i++) s[i] += x[(g + i) * GROUP + j];
        memcpy(sums + g, s, sizeof s);
    }
    for (; g < groups; g++) {
        float s = 0.0f;
        for (int j = 0; j < GROUP; j++) s += x[g * GROUP + j];
        sums[g] = s;
    }
    for (g = 0; g < groups; g++) {
        const float *v = x + g * GROUP, amax = group_amax(v);
        const float s = amax > 0.0f ? pow2_above(amax / 127.0f) : 1.0f; /* amax / 127 < s */
        /* quantize_row's roundings in 8 lanes: the same correctly rounded divisions and roundings to even */
        const __m256 sv = _mm256_set1_ps(s), fine = _mm256_set1_ps(128.0f / s), step = _mm256_set1_ps(128.0f);
        __m256i t[4];
        for (int c = 0; c < 4; c++) {
            const __m256 xv = _mm256_loadu_ps(v + 8 * c);
            const __m256 hi = _mm256_round_ps(_mm256_div_ps(xv, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256 lo = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(xv, _mm256_mul_ps(hi, sv)), fine),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            t[c] = _mm256_cvtps_epi32(_mm256_add_ps(_mm256_mul_ps(hi, step), lo)); /* exact: |x| <= 16320 */
        }
        for (int c = 0; c < 2; c++) /* packs works per 128-bit half: the permute restores the order */
            _mm256_storeu_si256((__m256i *)(x16 + g * GROUP + 16 * c),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(t[2 * c], t[2 * c + 1]), 0xD8));
        scale[g] = s / 128.0f;
    }
}
