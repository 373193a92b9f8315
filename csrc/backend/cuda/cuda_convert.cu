/*
 * cuda_convert.cu — dtype conversions on the GPU (ct_op_convert), the CPU backend's bits.
 *
 * The element function is ct_convert_math.h's, as on the CPU and in the mock backend; the
 * dtype pair is a template argument, so each kernel is one straight conversion. setup.py
 * builds this file with -ftz=false: float16's subnormal rounding (ct_rm_f32_to_f16) adds
 * denormal floats, which flush-to-zero would lose.
 */
#include "cuda_common.cuh"

#include "../../core/ct_convert_math.h"

template <int S, int D>
__global__ void convert_kernel(long long n, const void *x, void *y) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        ct_cv_elem(S, x, D, y, i);
}

template <int S>
static void convert_from(int d, cudaStream_t s, long long n, const void *x, void *y) {
    long long blocks = (n + 255) / 256;
    unsigned g = (unsigned)(blocks < 65536 ? blocks : 65536); /* grid-stride beyond */
    switch (d) {
    case CT_F32: convert_kernel<S, CT_F32><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_F16: convert_kernel<S, CT_F16><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_BF16: convert_kernel<S, CT_BF16><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_I32: convert_kernel<S, CT_I32><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_U32: convert_kernel<S, CT_U32><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_U8: convert_kernel<S, CT_U8><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_I8: convert_kernel<S, CT_I8><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_I16: convert_kernel<S, CT_I16><<<g, 256, 0, s>>>(n, x, y); break;
    case CT_U16: convert_kernel<S, CT_U16><<<g, 256, 0, s>>>(n, x, y); break;
    default: convert_kernel<S, CT_BOOL><<<g, 256, 0, s>>>(n, x, y); break;
    }
}

extern "C" ct_status ct_cuda_convert(ct_device *dev, int64_t n, int sdt, const void *x, int ddt,
                                     void *y) {
    if (n == 0) return CT_OK;
    CT_CUDA_TRY(cudaSetDevice(dev->ordinal));
    cudaStream_t s = ct_cuda_stream(dev);
    switch (sdt) {
    case CT_F32: convert_from<CT_F32>(ddt, s, n, x, y); break;
    case CT_F16: convert_from<CT_F16>(ddt, s, n, x, y); break;
    case CT_BF16: convert_from<CT_BF16>(ddt, s, n, x, y); break;
    case CT_I32: convert_from<CT_I32>(ddt, s, n, x, y); break;
    case CT_U32: convert_from<CT_U32>(ddt, s, n, x, y); break;
    case CT_U8: convert_from<CT_U8>(ddt, s, n, x, y); break;
    case CT_I8: convert_from<CT_I8>(ddt, s, n, x, y); break;
    case CT_I16: convert_from<CT_I16>(ddt, s, n, x, y); break;
    case CT_U16: convert_from<CT_U16>(ddt, s, n, x, y); break;
    default: convert_from<CT_BOOL>(ddt, s, n, x, y); break;
    }
    CT_CUDA_TRY(cudaGetLastError());
    return CT_OK;
}
