/*
 * ct_hd.h — CT_HD marks small inline functions compiled for both the host (C)
 * and CUDA devices, so a CPU kernel and its GPU twin evaluate the same code.
 */
#ifndef CT_HD_H
#define CT_HD_H

#ifdef __CUDACC__
#define CT_HD __host__ __device__
#else
#define CT_HD
#endif

#endif /* CT_HD_H */
