/* Whether this CPU runs the instructions the including build was compiled for: every kernel library exports it, and
 * build.py loads a build only where it returns 1 (a library built with -mavx512vnni must not run on an AVX2 CPU, one
 * built with +dotprod not on a Cortex-A53). */
#ifndef PRIMA_CPU_OK_H
#define PRIMA_CPU_OK_H
#if defined(__aarch64__)
#if defined(__linux__)
#include <sys/auxv.h>
#endif
int prima_cpu_ok(void) {
#if defined(__ARM_FEATURE_DOTPROD)
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; /* SDOT / UDOT (Armv8.2's optional dot product) */
#else
    return 0; /* no HWCAP to ask: the plain NEON build runs instead */
#endif
#else
    return 1; /* NEON (ASIMD) is part of every aarch64 CPU */
#endif
}
#else
int prima_cpu_ok(void) {
    __builtin_cpu_init();
    int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#if defined(__AVX512BW__)
    ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#if defined(__AVX512VNNI__)
    ok = ok && __builtin_cpu_supports("avx512vnni");
#endif
    return ok;
}
#endif
#endif
