/* The kernel libraries (q4, f32, ops: argv 1-3) on fixed pseudo-random inputs, without Python: a row's bits the same
 * alone and in a call of 9, an identity gives the weights back (int4, int8), each result near the exact product,
 * and a digest of every output per kernel, for comparing builds bit for bit (AVX2 and NEON ones agree). Built and
 * run for both machines by tools/arm64_emulation.sh quick; exits 1 on any failed check. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*count_fn)(void);
typedef void (*q4_tile_fn)(const uint8_t *, const uint16_t *, uint8_t *, int64_t, int64_t, int);
typedef int (*one_fn)(const void *, const float *, float *, int64_t, int64_t, int64_t, int, int);
typedef int (*two_fn)(const void *, const void *, const float *, float *, int64_t, int64_t, int64_t, int, int);
typedef void (*i8_tile_fn)(const int8_t *, int8_t *, int64_t, int64_t, int);
typedef void (*f32_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int);
typedef void (*rms_fn)(const float *, const float *, float *, int64_t, int64_t, float);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t, int);
typedef int (*attend_fn)(const float *, const float *, const float *, float *, float *, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, const float *, const float *, float, int);

static void *lib[3];
static int failed = 0;
static uint64_t state = 88172645463325252ull, digest;

static void *fn(int l, const char *name) {
    void *f = dlsym(lib[l], name);
    if (f == NULL) printf("no %s\n", name), exit(2);
    return f;
}
static float uniform(void) { /* xorshift64: [-1, 1) */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (float)((state >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}
static uint16_t to_half(float f) { _Float16 h = (_Float16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
static float from_half(uint16_t u) { _Float16 h; memcpy(&h, &u, 2); return (float)h; }
static void mix(const float *y, int64_t n) { /* FNV-1a over the bytes */
    for (int64_t i = 0; i < 4 * n; i++) digest = (digest ^ ((const uint8_t *)y)[i]) * 1099511628211ull;
}
static void check(int ok, const char *what, int64_t n, int mode) {
    if (!ok) failed = 1, printf("FAIL %s (n %ld, mode %d)\n", what, (long)n, mode);
}

/* y [M, N] = x @ w.T through the layout the build keeps: q4.c's tiles (AVX2) or rows; int8 likewise */
static int64_t N, K;
static uint8_t *q, *tiles;
static uint16_t *dm;
static int8_t *w8, *tiles8;
static float *scale8;
static void q4(const float *x, float *y, int64_t m, int mode) {
    if (((count_fn)fn(0, "prima_q4_tiles"))()) {
        ((q4_tile_fn)fn(0, "prima_q4_tile"))(q, dm, tiles, N, K, 1);
        ((one_fn)fn(0, "prima_q4_tiled_mm"))(tiles, x, y, m, N, K, mode, 4);
    } else ((two_fn)fn(0, "prima_q4_mm"))(q, dm, x, y, m, N, K, mode, 4);
}
static void int8(const float *x, float *y, int64_t m, int mode) {
    if (((count_fn)fn(0, "prima_q4_tiles"))()) {
        ((i8_tile_fn)fn(0, "prima_int8_tile"))(w8, tiles8, N, K, 1);
        ((two_fn)fn(0, "prima_int8_tiled_mm"))(tiles8, scale8, x, y, m, N, K, mode, 4);
    } else ((two_fn)fn(0, "prima_int8_mm"))(w8, scale8, x, y, m, N, K, mode, 4);
}
static double weight(int int8_kind, int64_t o, int64_t j) { /* the exact weight [o, j] */
    if (int8_kind) return (double)w8[o * K + j] * scale8[o];
    const int64_t g = K / 32, i = j % 32, byte = q[o * K / 2 + j / 32 * 16 + i % 16];
    const double d = from_half(dm[o * 2 * g + j / 32]), m = from_half(dm[(o * 2 + 1) * g + j / 32]);
    return d * (i < 16 ? byte & 15 : byte >> 4) + m;
}

/* one quantized kernel in one mode: row invariance, near the exact product, the identity's weights (exact mode) */
static void quantized(void (*mm)(const float *, float *, int64_t, int), int int8_kind, int mode, const float *x) {
    const int64_t m = 9;
    float *y = malloc(m * N * 4), *one = malloc(N * 4), *eye = calloc(K * K, 4), *ye = malloc(K * N * 4);
    mm(x, y, m, mode);
    mix(y, m * N);
    for (int64_t r = 0; r < m; r++) {
        mm(x + r * K, one, 1, mode);
        check(!memcmp(one, y + r * N, N * 4), "row alone", N, mode);
    }
    double worst = 0, top = 0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t o = 0; o < N; o++) {
            double e = 0;
            for (int64_t j = 0; j < K; j++) e += x[r * K + j] * weight(int8_kind, o, j);
            worst = fmax(worst, fabs(e - y[r * N + o])), top = fmax(top, fabs(e));
        }
    check(worst / top < (mode ? 0.02 : 6e-4), int8_kind ? "int8 error" : "int4 error", N, mode);
    if (mode == 0) { /* exact: an exact activation gives the weights back bit for bit */
        for (int64_t j = 0; j < K; j++) eye[j * K + j] = 1;
        mm(eye, ye, K, mode);
        int same = 1;
        for (int64_t j = 0; j < K; j++)
            for (int64_t o = 0; o < N; o++) same &= ye[j * N + o] == (float)weight(int8_kind, o, j);
        check(same, "identity", N, mode);
    }
    free(y), free(one), free(eye), free(ye);
}

int main(int argc, char **argv) {
    for (int l = 0; l < 3; l++)
        if (argc < 4 || (lib[l] = dlopen(argv[l + 1], RTLD_NOW)) == NULL)
            return printf("usage: check q4.so f32.so ops.so (%s)\n", argc < 4 ? "" : dlerror()), 2;
    printf("cpu_ok %d %d %d\n", ((count_fn)fn(0, "prima_cpu_ok"))(), ((count_fn)fn(1, "prima_cpu_ok"))(),
           ((count_fn)fn(2, "prima_cpu_ok"))());
    fflush(stdout); /* a build this CPU does not run dies next */
    const int64_t shapes[3][2] = {{37, 160}, {64, 96}, {130, 576}};
    uint64_t sums[3] = {1469598103934665603ull, 1469598103934665603ull, 1469598103934665603ull};
    for (int s = 0; s < 3; s++) {
        N = shapes[s][0], K = shapes[s][1];
        const int64_t g = K / 32;
        q = malloc(N * K / 2), dm = malloc(N * 2 * g * 2), w8 = malloc(N * K), scale8 = malloc(N * 4);
        tiles = malloc((N + 7) / 8 * g * 160), tiles8 = malloc((N + 7) / 8 * 8 * K);
        float *x = malloc(9 * K * 4), *wf = malloc(N * (K + 3) * 4), *xf = malloc(9 * (K + 3) * 4);
        float *y = malloc(9 * N * 4), *one = malloc(N * 4);
        for (int64_t i = 0; i < N * K / 2; i++) q[i] = (uint8_t)((uniform() + 1) * 128);
        for (int64_t i = 0; i < N * 2 * g; i++) dm[i] = to_half(uniform() * 0.01f);
        for (int64_t i = 0; i < N * K; i++) w8[i] = (int8_t)(uniform() * 127.5f);
        for (int64_t i = 0; i < N; i++) scale8[i] = 0.001f * (1.5f + uniform());
        for (int64_t i = 0; i < 9 * K; i++) x[i] = uniform() * powf(10.0f, (float)(i % K) * 8 / K - 6);
        for (int64_t i = 0; i < N * (K + 3); i++) wf[i] = uniform();
        for (int64_t i = 0; i < 9 * (K + 3); i++) xf[i] = uniform();
        for (int mode = 0; mode < 2; mode++) {
            digest = sums[0], quantized(q4, 0, mode, x), sums[0] = digest;
            digest = sums[1], quantized(int8, 1, mode, x), sums[1] = digest;
        }
        const int64_t kf = K + 3; /* f32: a tail shorter than a vector */
        f32_fn f32 = (f32_fn)fn(1, "prima_f32_mm");
        f32(wf, xf, y, 9, N, kf, 4);
        digest = sums[2], mix(y, 9 * N), sums[2] = digest;
        for (int64_t r = 0; r < 9; r++) {
            f32(wf, xf + r * kf, one, 1, N, kf, 1);
            check(!memcmp(one, y + r * N, N * 4), "f32 row alone", N, 0);
        }
        for (int64_t r = 0; r < 9; r++)
            for (int64_t o = 0; o < N; o++) {
                double e = 0, a = 0;
                for (int64_t j = 0; j < kf; j++) {
                    const double p = (double)xf[r * kf + j] * wf[o * kf + j];
                    e += p, a += fabs(p);
                }
                check(fabs(e - y[r * N + o]) <= kf * 0x1p-24 * a, "f32 error", N, 0);
            }
        free(q), free(dm), free(w8), free(scale8), free(tiles), free(tiles8);
        free(x), free(wf), free(xf), free(y), free(one);
    }
    digest = 1469598103934665603ull; /* ops: RMSNorm, RoPE + KV write + attention (head dims 36: a tail, and 64) */
    for (int64_t hd = 36; hd <= 64; hd += 28) {
        const int64_t nh = 4, nkv = 2, t = 3, pos = 5, cap = 16, width = (nh + 2 * nkv) * hd;
        float *qkv = malloc(t * width * 4), *c = malloc(cap * hd * 4), *sn = malloc(cap * hd * 4);
        float *kv = malloc(2 * nkv * cap * hd * 4), *out = malloc(t * nh * hd * 4), *w = malloc(hd * 4);
        float *normed = malloc(t * width * 4);
        for (int64_t i = 0; i < t * width; i++) qkv[i] = uniform();
        for (int64_t i = 0; i < cap * hd; i++) c[i] = uniform(), sn[i] = uniform();
        for (int64_t i = 0; i < 2 * nkv * cap * hd; i++) kv[i] = uniform();
        for (int64_t i = 0; i < hd; i++) w[i] = uniform();
        ((attend_fn)fn(2, "prima_attend_rows"))(qkv, c, sn, kv, out, t, pos, nh, nkv, hd, hd, cap, 0, 0.125f, NULL,
                                                NULL, 1e-6f, 2);
        ((rms_fn)fn(2, "prima_rms_norm"))(qkv, w, normed, t * width / hd, hd, 1e-5f);
        mix(out, t * nh * hd), mix(kv, 2 * nkv * cap * hd), mix(normed, t * width);
        free(qkv), free(c), free(sn), free(kv), free(out), free(w), free(normed);
    }
    const uint64_t ops_digest = digest;
    digest = 1469598103934665603ull; /* silu_mul (its own exp): 3 rows of I = 1003 (a tail), g over all of float32 */
    {
        const int64_t rows = 3, inter = 1003;
        float *gu = malloc(rows * 2 * inter * 4), *out = malloc(rows * inter * 4), *one = malloc(inter * 4);
        const float ends[] = {0.0f, -0.0f, 88.0f, -88.0f, -103.0f, -104.5f, -120.5f, 1e38f, -1e38f, INFINITY,
                              -INFINITY, NAN, 1e-30f, -1e-30f, 16.7f, -16.7f};
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < inter; j++) {
                const int64_t e = j % 64;
                float g = e < 16 ? ends[e] : uniform() * powf(2.0f, uniform() * 8.0f) * (e < 40 ? 1.0f : 16.0f);
                if (e >= 60) { /* any bit pattern */
                    uint32_t u = (uint32_t)(state >> 16);
                    uniform(), memcpy(&g, &u, 4);
                }
                gu[r * 2 * inter + j] = g, gu[r * 2 * inter + inter + j] = uniform() * 4;
            }
        silu_fn silu_mul = (silu_fn)fn(2, "prima_silu_mul");
        silu_mul(gu, out, rows, inter, 2);
        mix(out, rows * inter);
        for (int64_t r = 0; r < rows; r++) {
            silu_mul(gu + r * 2 * inter, one, 1, inter, 1);
            check(!memcmp(one, out + r * inter, inter * 4), "silu_mul row alone", inter, 0);
        }
        double worst = 0; /* ulps of silu alone (up = 1) against a double reference, finite g */
        for (int64_t j = 0; j < inter; j++) gu[inter + j] = 1.0f;
        silu_mul(gu, one, 1, inter, 1);
        for (int64_t j = 0; j < inter; j++) {
            const double g = gu[j], e = g < -700 ? 0.0 : g / (1.0 + exp(-g));
            if (!isfinite(g)) continue;
            const double ulp = fmax(nextafterf(fabsf((float)e), INFINITY) - fabsf((float)e), 0x1p-149);
            worst = fmax(worst, fabs(one[j] - e) / ulp);
        }
        check(worst <= 2.0, "silu ulps", inter, 0);
        free(gu), free(out), free(one);
    }
    printf("digests q4 %016llx int8 %016llx f32 %016llx ops %016llx silu %016llx\n", (unsigned long long)sums[0],
           (unsigned long long)sums[1], (unsigned long long)sums[2], (unsigned long long)ops_digest,
           (unsigned long long)digest);
    printf("%s\n", failed ? "FAILED" : "ok");
    return failed;
}
