/*
 * ct_random_vpoly.h — the polynomials of ct_random_math.h's log, log1p and
 * erf_inv spelled once for any SIMD width: included by the hand-vectorised
 * normal tiles (ct_random_x86.c for AVX-512, ct_random_avx2.c for AVX2),
 * which first define
 *
 *   CT_VF                  the vector float type (__m512, __m256)
 *   CT_VFN                 the functions' attributes (static inline, target)
 *   CT_VSET1(c)            a vector of c
 *   CT_VFMA(a, b, c)       a * b + c, one rounding
 *   CT_VMUL, CT_VADD, CT_VSUB, CT_VDIV
 *
 * Each function performs the scalar definition's float operations in the
 * same order with the same fusion, so its lanes equal ct_random_math.h's
 * results bit for bit (the includers compile with contraction off). The
 * selects around them (lane masks differ between ISAs) stay in the includers.
 */
#ifndef CT_RANDOM_VPOLY_H
#define CT_RANDOM_VPOLY_H

/* ct_rm_log after its range reduction: m in [sqrt(1/2) - 1, sqrt(2) - 1), e the exponent. */
CT_VFN CT_VF ct_vlog_poly(CT_VF m, CT_VF e) {
    CT_VF x2 = CT_VMUL(m, m), x3 = CT_VMUL(x2, m);
    CT_VF y = CT_VFMA(CT_VSET1(7.0376836292E-2f), m, CT_VSET1(-1.1514610310E-1f));
    CT_VF y1 = CT_VFMA(CT_VSET1(-1.2420140846E-1f), m, CT_VSET1(1.4249322787E-1f));
    CT_VF y2 = CT_VFMA(CT_VSET1(2.0000714765E-1f), m, CT_VSET1(-2.4999993993E-1f));
    y = CT_VFMA(y, m, CT_VSET1(1.1676998740E-1f));
    y1 = CT_VFMA(y1, m, CT_VSET1(-1.6668057665E-1f));
    y2 = CT_VFMA(y2, m, CT_VSET1(3.3333331174E-1f));
    y = CT_VFMA(y, x3, y1);
    y = CT_VFMA(y, x3, y2);
    y = CT_VFMA(y, x3, CT_VMUL(CT_VSET1(-2.12194440e-4f), e));
    CT_VF r = CT_VSUB(m, CT_VMUL(CT_VSET1(0.5f), x2));
    r = CT_VADD(r, y);
    return CT_VADD(r, CT_VMUL(CT_VSET1(0.693359375f), e));
}

/* ct_rm_log1p_small. */
CT_VFN CT_VF ct_vlog1p_small(CT_VF x) {
    CT_VF x2 = CT_VMUL(x, x);
    CT_VF num = CT_VSET1(4.5270000862445199635E-5f);
    num = CT_VFMA(num, x, CT_VSET1(4.9854102823193375972E-1f));
    num = CT_VFMA(num, x, CT_VSET1(6.5787325942061044846E0f));
    num = CT_VFMA(num, x, CT_VSET1(2.9911919328553073277E1f));
    num = CT_VFMA(num, x, CT_VSET1(6.0949667980987787057E1f));
    num = CT_VFMA(num, x, CT_VSET1(5.7112963590585538103E1f));
    num = CT_VFMA(num, x, CT_VSET1(2.0039553499201281259E1f));
    CT_VF den = CT_VSET1(1.0f);
    den = CT_VFMA(den, x, CT_VSET1(1.5062909083469192198E1f));
    den = CT_VFMA(den, x, CT_VSET1(8.3047565967967209469E1f));
    den = CT_VFMA(den, x, CT_VSET1(2.2176239823732856465E2f));
    den = CT_VFMA(den, x, CT_VSET1(3.0909872225312059774E2f));
    den = CT_VFMA(den, x, CT_VSET1(2.1642788614495947685E2f));
    den = CT_VFMA(den, x, CT_VSET1(6.0118660497603843919E1f));
    return CT_VADD(x, CT_VFMA(CT_VSET1(-0.5f), x2,
                              CT_VMUL(CT_VMUL(x, x2), CT_VDIV(num, den))));
}

/* ct_rm_erfinv_central: the polynomial in w - 2.5, times x. */
CT_VFN CT_VF ct_verfinv_central(CT_VF x, CT_VF w) {
    CT_VF v = CT_VSUB(w, CT_VSET1(2.5f));
    CT_VF p = CT_VSET1(2.81022636e-08f);
    p = CT_VFMA(p, v, CT_VSET1(3.43273939e-07f));
    p = CT_VFMA(p, v, CT_VSET1(-3.5233877e-06f));
    p = CT_VFMA(p, v, CT_VSET1(-4.39150654e-06f));
    p = CT_VFMA(p, v, CT_VSET1(0.00021858087f));
    p = CT_VFMA(p, v, CT_VSET1(-0.00125372503f));
    p = CT_VFMA(p, v, CT_VSET1(-0.00417768164f));
    p = CT_VFMA(p, v, CT_VSET1(0.246640727f));
    p = CT_VFMA(p, v, CT_VSET1(1.50140941f));
    return CT_VMUL(p, x);
}

/* ct_rm_erfinv_tail without its |x| == 1 case: the polynomial in v = sqrt(w) - 3, times x. */
CT_VFN CT_VF ct_verfinv_tail_poly(CT_VF x, CT_VF v) {
    CT_VF p = CT_VSET1(-0.000200214257f);
    p = CT_VFMA(p, v, CT_VSET1(0.000100950558f));
    p = CT_VFMA(p, v, CT_VSET1(0.00134934322f));
    p = CT_VFMA(p, v, CT_VSET1(-0.00367342844f));
    p = CT_VFMA(p, v, CT_VSET1(0.00573950773f));
    p = CT_VFMA(p, v, CT_VSET1(-0.0076224613f));
    p = CT_VFMA(p, v, CT_VSET1(0.00943887047f));
    p = CT_VFMA(p, v, CT_VSET1(1.00167406f));
    p = CT_VFMA(p, v, CT_VSET1(2.83297682f));
    return CT_VMUL(p, x);
}

#endif /* CT_RANDOM_VPOLY_H */
