/*
 * ct_simd.h — function multiversioning for vectorised CPU kernels.
 *
 * CT_MULTIVERSION before a function definition makes GCC compile it for
 * x86-64-v4 (AVX-512 F/BW/DQ/VL), x86-64-v3 (AVX2, FMA, BMI2) and the
 * baseline ISA and pick one at load time (ifunc) by CPU *features*.
 * (Not "arch=skylake-avx512"/"arch=haswell": GCC resolves those with
 * __builtin_cpu_is, an exact CPU-model match, so every AMD CPU and every
 * newer Intel one silently got the baseline clone, with fmaf() as a libm call.)
 * Kernels marked with it must give bit-identical results on every clone:
 * they use integer arithmetic, correctly rounded IEEE operations and explicit
 * fmaf() only (the core is compiled with fp-contract off; fmaf is exact on
 * every path, a library call on the baseline).
 * Define CT_NO_MULTIVERSION to compile a single baseline version.
 * CT_CLONE_IS_V4() tells a multiversioned kernel, at run time, whether it is
 * the x86-64-v4 clone (to pick a tuning such as a lane count; never results).
 */
#ifndef CT_SIMD_H
#define CT_SIMD_H

/* GCC 12: first with ISA levels in both target_clones and __builtin_cpu_supports. */
#if !defined(CT_NO_MULTIVERSION) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 12 && defined(__x86_64__) && defined(__linux__) && \
    !defined(__SANITIZE_ADDRESS__)
#define CT_MULTIVERSION \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
/* True inside the clone the resolver picks for x86-64-v4 (the CPU has it). */
#define CT_CLONE_IS_V4() __builtin_cpu_supports("x86-64-v4")
#else
#define CT_MULTIVERSION
#if defined(__AVX512F__)
#define CT_CLONE_IS_V4() 1
#else
#define CT_CLONE_IS_V4() 0
#endif
#endif

#endif /* CT_SIMD_H */
