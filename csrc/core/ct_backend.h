/*
 * ct_backend.h — the seam between the core and a device backend.
 *
 * A backend is a table of function pointers. The core calls only these to
 * touch device memory; it never knows whether the bytes live in host RAM or
 * on a GPU. csrc/backend/cpu implements it with host memory and OpenMP; a CUDA
 * backend (csrc/backend/cuda, later) fills the same table with cudaMalloc,
 * streams and kernels. A backend knows neither Python nor logical rules.
 */
#ifndef CT_BACKEND_H
#define CT_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ct_status.h"

typedef enum { CT_PLATFORM_CPU = 0, CT_PLATFORM_GPU = 1, CT_NUM_PLATFORMS } ct_platform;

struct ct_device;
struct ct_opt_pass;
struct ct_random_consts; /* ct_random_math.h */
struct ct_rm_block;
struct ct_chain_step_; /* ct_ops.h */

typedef struct ct_backend {
    const char *name;       /* "cpu", "cuda" */
    ct_platform platform;
    /* Memory. alloc returns CT_EOOM (with the message set) when the backend
     * itself has no memory; the per-device limit is enforced by ct_device. */
    ct_status (*alloc)(struct ct_device *dev, size_t nbytes, void **out);
    void (*free)(struct ct_device *dev, void *ptr, size_t nbytes);
    /* Strided n-d block copy. `dst_dev`/`src_dev` name the device that owns
     * each side, or NULL for host memory (so one entry covers h2d, d2h, d2d
     * and host-to-host). Strides are in bytes. The copy is complete when the
     * call returns, except one within a single device: that is queued on its
     * stream, ordered before anything queued there later, as a kernel is. */
    ct_status (*copy_block)(struct ct_device *dst_dev, struct ct_device *src_dev, int ndim,
                            const int64_t *shape, size_t itemsize, void *dst,
                            const int64_t *dst_strides, const void *src,
                            const int64_t *src_strides);
    /* Many dense byte ranges between host memory and one device in a single
     * round trip: segment i copies nbytes[i] bytes from src[i] to dst[i];
     * exactly one of dst_dev / src_dev is a device of this backend, the other
     * NULL (host). Device -> host: the copies are complete when the call
     * returns. Host -> device: the sources have been read when it returns (the
     * caller may free them) and the copies are queued on the device's stream,
     * ordered before anything queued there later, as a kernel launch is.
     * NULL: the core calls copy_block once per segment instead. */
    ct_status (*copy_segments)(struct ct_device *dst_dev, struct ct_device *src_dev, int nseg,
                               void *const *dst, const void *const *src, const size_t *nbytes);
    /* Wait for all work queued on the device. */
    ct_status (*synchronize)(struct ct_device *dev);
    /* Set up a logical device (stream, limits) once, when the registry is
     * created; may be NULL. */
    ct_status (*init_device)(struct ct_device *dev);

    /* Array-op kernels (see ct_ops.h for the semantics); NULL = unsupported. */
    ct_status (*unary)(struct ct_device *dev, int op, float alpha, float beta, int64_t n,
                       const float *x, float *y);
    ct_status (*binary)(struct ct_device *dev, int op, int ndim, const int64_t *shape, float *out,
                        const float *a, const int64_t *a_strides, const float *b,
                        const int64_t *b_strides);
    ct_status (*reduce)(struct ct_device *dev, int op, int ndim, const int64_t *shape,
                        uint32_t axes, const float *x, float *out);
    /* gemm's `prec` is a CT_PREC_* code (validated by the core): the operands are rounded
     * to TF32 / bfloat16 as ct_prec_math.h defines before a float32-accumulated product. */
    ct_status (*gemm)(struct ct_device *dev, int trans_a, int trans_b, int64_t m, int64_t n,
                      int64_t k, float alpha, const float *a, int64_t lda, const float *b,
                      int64_t ldb, float beta, float *c, int64_t ldc, int prec);
    ct_status (*allreduce)(struct ct_device **devs, float **bufs, int nbufs, int64_t count,
                           int op);
    /* Embedding rows (ct_ops.h: ct_op_gather_rows / ct_op_scatter_add_rows). */
    ct_status (*gather_rows)(struct ct_device *dev, const float *table, int64_t nrows,
                             int64_t ncols, int64_t row0, const int32_t *ids, int64_t nids,
                             float *out);
    ct_status (*scatter_add_rows)(struct ct_device *dev, float *table, int64_t nrows,
                                  int64_t ncols, int64_t row0, const int32_t *hit,
                                  const int32_t *start, int64_t nhit, const int32_t *pos,
                                  const float *g);
    /* One fused optimizer pass over a device's blocks (see ct_opt_pass in
     * ct_optim.h). The apply pass is queued on the device's stream; a reduce
     * pass returns its sums in acc[2] (a host round trip). NULL: the core's
     * CPU driver runs the step (host memory). */
    ct_status (*optim_pass)(struct ct_device *dev, const struct ct_opt_pass *pass, double *acc);

    /* PRNG block fill on the device (ct_random_math.h): write the samples of
     * sampler constants `c` under key (k0, k1) for the block `blk` of a global
     * array into `out` (device memory, blk->count dense elements), queued on
     * the device's stream. NULL: the core fills on the host instead. */
    ct_status (*random_fill)(struct ct_device *dev, uint32_t k0, uint32_t k1,
                             const struct ct_random_consts *c, const struct ct_rm_block *blk,
                             void *out);
    /* Elementwise dtype conversion of n dense elements (ct_op_convert, ct_convert_math.h),
     * queued on the device's stream. NULL: unsupported (the core says so). */
    ct_status (*convert)(struct ct_device *dev, int64_t n, int src_dtype, const void *x,
                         int dst_dtype, void *y);
    /* Typed elementwise op (ct_op_ewise, ct_ewise_math.h) with broadcasting strides, and the
     * integer reduction (ct_op_reduce_typed), queued on the device's stream. The core has
     * validated op and dtype; a unary op gets b == a. NULL: unsupported. */
    ct_status (*ewise)(struct ct_device *dev, int op, int dtype, int ndim, const int64_t *shape,
                       void *out, const void *a, const int64_t *a_strides, const void *b,
                       const int64_t *b_strides);
    ct_status (*reduce_typed)(struct ct_device *dev, int op, int dtype, int ndim,
                              const int64_t *shape, uint32_t axes, const void *x, void *out);
    /* optim_pass implements adafactor's FACTORED stage (statistics pass reduce = 4 and the
     * factors in later passes, see ct_opt_pass); 0: such steps are staged through the host. */
    int optim_factored;
    /* A fused chain of float32 elementwise steps as one kernel (ct_op_chain, ct_ops.h),
     * queued on the device's stream. NULL: the steps run one by one. */
    ct_status (*chain)(struct ct_device *dev, int ndim, const int64_t *shape, const float *a,
                       const int64_t *a_strides, int nsteps, const struct ct_chain_step_ *steps,
                       float *out);
    /* A unary op (ct_op_unary's) on n bfloat16 or float16 elements in one kernel: each
     * widened to float32, the float32 formula, rounded back (ct_op_unary_typed), queued on the
     * device's stream. NULL: unsupported. */
    ct_status (*unary_typed)(struct ct_device *dev, int op, float alpha, float beta, int64_t n,
                             int dtype, const void *x, void *y);
    /* Graphs of queued work (CUDA graphs; jit's replays, py_dispatch.c). graph_begin starts
     * capturing what this thread queues on dev's stream: from then on the kernels are
     * recorded, not run, and nothing that synchronises or allocates may be called for the
     * device. graph_end stops the capture. With keep, *exec runs what was captured: made when
     * *exec is NULL, else updated in place when the capture has the same kernels in the same
     * order (other arguments: *updated = 1), else destroyed and made again. Without keep (a
     * failed capture) the capture is dropped and *exec left as it is. graph_launch queues
     * exec on dev's stream, as the captured work would have been; graph_free destroys it
     * (a launch in flight completes). NULL: the backend has no graphs. */
    ct_status (*graph_begin)(struct ct_device *dev);
    ct_status (*graph_end)(struct ct_device *dev, int keep, void **exec, int *updated);
    ct_status (*graph_launch)(struct ct_device *dev, void *exec);
    void (*graph_free)(struct ct_device *dev, void *exec);
    /* NCCL across processes. nccl_unique_id writes a new ncclUniqueId (CT_NCCL_ID_BYTES
     * bytes) into id; the process that holds rank 0 of a communicator makes it, and the caller
     * broadcasts it to the others through the MPI engine (ct_dist_broadcast).
     * allreduce_ranks all-reduces (in place, float32, op CT_RED_*) a group of buffers whose
     * members live in several processes: devs/bufs are this process's members (nbufs >= 1),
     * ranks[i] the rank (0 .. nranks-1) in the group's communicator of the GPU bufs[i] lives
     * on (logical devices of one GPU share a rank: they are combined on their GPU first). The
     * communicator of `id` is created at the first call with it (ncclCommInitRank, every rank
     * of every process calling together) and cached; every process calls with the same id,
     * count and op, collectives in the same order. NULL: no such engine (the caller gathers
     * through the host instead). */
    ct_status (*nccl_unique_id)(struct ct_device *dev, unsigned char *id);
    ct_status (*allreduce_ranks)(struct ct_device **devs, float **bufs, int nbufs, int64_t count,
                                 int op, const unsigned char *id, int nranks, const int *ranks);
} ct_backend;

/* The size of an ncclUniqueId (nccl.h: NCCL_UNIQUE_ID_BYTES). */
#define CT_NCCL_ID_BYTES 128

/* The CPU backend (csrc/backend/cpu/cpu_backend.c). */
extern const ct_backend ct_cpu_backend;

/* --- loadable backends ----------------------------------------------------
 * The CUDA backend is a separate shared library (so that importing
 * ctrainstate never needs CUDA libraries or a driver). The core dlopen()s it
 * and calls its entry point with the services it may use. */

typedef struct {
    int abi_version; /* CT_BACKEND_ABI_VERSION */
    ct_status (*set_error)(ct_status st, const char *fmt, ...);
} ct_core_services;

/* 2: copy_segments; 3: reduce/allreduce take an op, row gathers; 4: gemm takes a precision
 * (CT_PREC_*: float32, TF32 or bfloat16 inputs); 5: convert (dtype conversions); 6: unary
 * CT_UN_LOG1P .. CT_UN_ERFC, binary CT_BIN_POW, CT_UN_SIGN keeps -0.0 and NaN; ewise and
 * reduce_typed (comparisons, booleans, integer arithmetic and reductions); 7: unary CT_UN_SINH ..
 * CT_UN_SIGNBIT, binary CT_BIN_ATAN2 .. CT_BIN_LDEXP; 8: binary CT_BIN_PICK (where keeps -0.0);
 * 9: chain (fused elementwise chains); 10: unary_typed (16-bit float unary ops); 11: graph_begin,
 * graph_end, graph_launch, graph_free (CUDA graphs); 12: nccl_unique_id, allreduce_ranks (NCCL
 * across processes) */
#define CT_BACKEND_ABI_VERSION 12
#define CT_CUDA_ENTRY_POINT "ct_cuda_backend_open"

/* Entry point of a loadable backend: fills *backend and *num_physical (GPUs
 * present, possibly 0) or returns an error with the reason set. */
typedef ct_status (*ct_backend_open_fn)(const ct_core_services *services,
                                        const ct_backend **backend, int *num_physical);

#endif /* CT_BACKEND_H */
