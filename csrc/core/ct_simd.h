/*
 * ct_simd.h — function multiversioning for vectorised CPU kernels.
 *
 * CT_MULTIVERSION before a function definition makes GCC compile it for
 * AVX-512, AVX2+FMA and the baseline ISA and pick one at load time (ifunc).
 * Kernels marked with it must give bit-identical results on every clone:
 * they use integer arithmetic, correctly rounded IEEE operations and explicit
 * fmaf() only (the core is compiled with fp-contract off; fmaf is exact on
 * every path, a library call on the baseline).
 * Define CT_NO_MULTIVERSION to compile a single baseline version.
 */
#ifndef CT_SIMD_H
#define CT_SIMD_H

#if !defined(CT_NO_MULTIVERSION) && defined(__GNUC__) && !defined(__clang__) && \
    defined(__x86_64__) && defined(__linux__) && !defined(__SANITIZE_ADDRESS__)
#define CT_MULTIVERSION \
    __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define CT_MULTIVERSION
#endif

#endif /* CT_SIMD_H */
