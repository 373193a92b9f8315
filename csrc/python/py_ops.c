/*
 * py_ops.c — bindings of the per-shard array ops (ct_ops.h).
 *
 * Each function takes lists of Buffers, one entry per shard, and runs the op
 * on every shard in one call with the GIL released. Which shards meet and
 * which collectives follow is decided by the Python layer (ctrainstate.numpy).
 * The buffers of a call are pinned (ct_py_pin) from the moment they are read
 * from the lists until the call returns: another thread may drop the lists or
 * delete the Arrays while the kernels run.
 */
#include "ct_py.h"

#include <string.h>

#include "../core/ct_ops.h"
#include "../backend/cpu/cpu_ops.h"

#define MAX_SHARDS CT_MAX_DEVICES

/* The pinned buffers of one list argument. Declared with BUF_LIST (only n is set: the
 * array is large) and released with put_buffers on every path out of the binding. */
typedef struct {
    Py_ssize_t n;
    ct_py_buffer *b[MAX_SHARDS];
} buf_list;

#define BUF_LIST(name) \
    buf_list name;     \
    name.n = 0

static void put_buffers(buf_list *l) {
    for (Py_ssize_t i = 0; i < l->n; i++) ct_py_unpin(l->b[i]);
    l->n = 0;
}

/* The devices and float32 data of a list's buffers, for the all-reduces. */
static void f32_blocks(const buf_list *l, ct_device **devs, float **bufs) {
    for (Py_ssize_t i = 0; i < l->n; i++) {
        devs[i] = l->b[i]->dev;
        bufs[i] = (float *)l->b[i]->data;
    }
}

/* Read and pin the buffers of `seq` into `out` (empty on entry); on failure none stays
 * pinned. */
static int get_buffers(PyObject *seq, buf_list *out, const char *what, int f32_only) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_SHARDS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: too many shards", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ct_py_buffer *b = ct_py_buffer_check(PySequence_Fast_GET_ITEM(fast, i), what);
        if (b != NULL && f32_only && b->dtype != CT_F32) {
            PyErr_Format(PyExc_TypeError, "%s: ops compute in float32, got %s", what,
                         ct_dtype_name(b->dtype));
            b = NULL;
        }
        if (b == NULL) {
            Py_DECREF(fast);
            put_buffers(out);
            return -1;
        }
        ct_py_pin(b);
        out->b[out->n++] = b;
    }
    Py_DECREF(fast);
    return 0;
}

static int same_len(const buf_list *a, const buf_list *b, const char *what) {
    if (a->n != b->n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd vs %zd shards", what, a->n, b->n);
        return -1;
    }
    return 0;
}

static int64_t nelem(const ct_py_buffer *b) { return (int64_t)(b->nbytes / ct_dtype_size(b->dtype)); }

/* A reduction's axis mask names only dims of the shard (bit d: dim d). */
static int axes_outside(uint32_t axes, int ndim, const char *what) {
    if (ndim < 32 && (axes >> ndim) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: axes mask 0x%x names dims outside rank %d", what,
                     (unsigned)axes, ndim);
        return -1;
    }
    return 0;
}

static PyObject *py_op_unary(PyObject *self, PyObject *args) {
    (void)self;
    int op;
    float alpha, beta;
    PyObject *xo, *yo;
    if (!PyArg_ParseTuple(args, "iffOO:op_unary", &op, &alpha, &beta, &xo, &yo)) return NULL;
    PyObject *ret = NULL;
    BUF_LIST(xs);
    BUF_LIST(ys);
    if (get_buffers(xo, &xs, "op_unary input", 1) < 0 || get_buffers(yo, &ys, "op_unary output", 1) < 0 ||
        same_len(&xs, &ys, "op_unary") < 0)
        goto out;
    for (Py_ssize_t i = 0; i < xs.n; i++)
        if (xs.b[i]->nbytes != ys.b[i]->nbytes || xs.b[i]->dev != ys.b[i]->dev) {
            PyErr_SetString(PyExc_ValueError, "op_unary: input and output shards differ");
            goto out;
        }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < xs.n && st == CT_OK; i++)
        st = ct_op_unary(xs.b[i]->dev, op, alpha, beta, nelem(xs.b[i]), xs.b[i]->data,
                         ys.b[i]->data);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&xs);
    put_buffers(&ys);
    return ret;
}

/* ys[i] = xs[i] converted to ys[i]'s dtype (ct_op_convert), shard by shard on each shard's
 * device: the buffers carry their dtypes; each pair must hold as many elements on one device. */
static PyObject *py_op_convert(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    if (!PyArg_ParseTuple(args, "OO:op_convert", &xo, &yo)) return NULL;
    PyObject *ret = NULL;
    BUF_LIST(xs);
    BUF_LIST(ys);
    if (get_buffers(xo, &xs, "op_convert input", 0) < 0 ||
        get_buffers(yo, &ys, "op_convert output", 0) < 0 || same_len(&xs, &ys, "op_convert") < 0)
        goto out;
    for (Py_ssize_t i = 0; i < xs.n; i++)
        if (nelem(xs.b[i]) != nelem(ys.b[i]) || xs.b[i]->dev != ys.b[i]->dev) {
            PyErr_SetString(PyExc_ValueError,
                            "op_convert: input and output shards differ in size or device");
            goto out;
        }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < xs.n && st == CT_OK; i++)
        st = ct_op_convert(xs.b[i]->dev, nelem(xs.b[i]), (int)xs.b[i]->dtype, xs.b[i]->data,
                           (int)ys.b[i]->dtype, ys.b[i]->data);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&xs);
    put_buffers(&ys);
    return ret;
}

/* Every 4-byte element of each buffer set to the 32-bit pattern `bits`, on the buffer's own
 * device: the backend's affine kernel with alpha 0 stores beta without reading x or doing
 * arithmetic, so the pattern is written unchanged whatever float it spells. On GPUs this
 * is a kernel launch on the device's stream (no host synchronisation, unlike a copy from
 * host memory); optimizer step counters use it. */
static PyObject *py_fill_bits32(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bo;
    uint32_t u;
    if (!PyArg_ParseTuple(args, "OO&:fill_bits32", &bo, ct_py_conv_u32, &u)) return NULL;
    PyObject *ret = NULL;
    BUF_LIST(bs);
    if (get_buffers(bo, &bs, "fill_bits32", 0) < 0) goto out;
    for (Py_ssize_t i = 0; i < bs.n; i++)
        if (ct_dtype_size(bs.b[i]->dtype) != 4) {
            PyErr_Format(PyExc_TypeError, "fill_bits32: needs 4-byte elements, got %s",
                         ct_dtype_name(bs.b[i]->dtype));
            goto out;
        }
    float beta;
    memcpy(&beta, &u, sizeof beta);
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < bs.n && st == CT_OK; i++)
        st = ct_op_unary(bs.b[i]->dev, CT_UN_AFFINE, 0.0f, beta, (int64_t)(bs.b[i]->nbytes / 4),
                         bs.b[i]->data, bs.b[i]->data);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&bs);
    return ret;
}

static PyObject *py_op_binary(PyObject *self, PyObject *args) {
    (void)self;
    int op;
    PyObject *oo, *ao, *bo;
    if (!PyArg_ParseTuple(args, "iOOO:op_binary", &op, &oo, &ao, &bo)) return NULL;
    PyObject *ret = NULL;
    BUF_LIST(os);
    BUF_LIST(as);
    BUF_LIST(bs);
    if (get_buffers(oo, &os, "op_binary output", 1) < 0 || get_buffers(ao, &as, "op_binary lhs", 1) < 0 ||
        get_buffers(bo, &bs, "op_binary rhs", 1) < 0 || same_len(&os, &as, "op_binary") < 0 ||
        same_len(&os, &bs, "op_binary") < 0)
        goto out;
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < os.n && st == CT_OK; i++) {
        ct_py_buffer *o = os.b[i], *a = as.b[i], *b = bs.b[i];
        int64_t sa[CT_MAX_NDIM], sb[CT_MAX_NDIM];
        if (a->dev != o->dev || b->dev != o->dev) {
            st = ct_set_error(CT_EINVAL, "op_binary: operands of one shard live on different devices");
            break;
        }
        st = ct_broadcast_strides(o->ndim, o->shape, a->ndim, a->shape, sa);
        if (st == CT_OK) st = ct_broadcast_strides(o->ndim, o->shape, b->ndim, b->shape, sb);
        if (st == CT_OK)
            st = ct_op_binary(o->dev, op, o->ndim, o->shape, o->data, a->data, sa, b->data, sb);
    }
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&os);
    put_buffers(&as);
    put_buffers(&bs);
    return ret;
}

/* outs[i] = op(lhs[i], rhs[i]) (ct_op_ewise) with numpy broadcasting of the shard shapes;
 * rhs None for a unary op. The operands' buffers share one dtype; the outputs have the
 * op's result dtype (bool for comparisons and is* tests). */
static PyObject *py_op_ewise(PyObject *self, PyObject *args) {
    (void)self;
    int op;
    PyObject *oo, *ao, *bo;
    if (!PyArg_ParseTuple(args, "iOOO:op_ewise", &op, &oo, &ao, &bo)) return NULL;
    if (op < 0 || op >= CT_EW_COUNT) {
        PyErr_Format(PyExc_ValueError, "op_ewise: unknown op %d", op);
        return NULL;
    }
    const int unary = op >= CT_EW_NOT;
    if (unary != (bo == Py_None)) {
        PyErr_Format(PyExc_TypeError, "op_ewise: op %d %s", op,
                     unary ? "is unary: rhs must be None" : "needs a rhs");
        return NULL;
    }
    PyObject *ret = NULL;
    BUF_LIST(os);
    BUF_LIST(as);
    BUF_LIST(bs);
    if (get_buffers(oo, &os, "op_ewise output", 0) < 0 || get_buffers(ao, &as, "op_ewise lhs", 0) < 0 ||
        same_len(&os, &as, "op_ewise") < 0)
        goto out;
    if (!unary && (get_buffers(bo, &bs, "op_ewise rhs", 0) < 0 || same_len(&os, &bs, "op_ewise") < 0))
        goto out;
    for (Py_ssize_t i = 0; i < os.n; i++) {
        int dt = (int)as.b[i]->dtype;
        if (!unary && (int)bs.b[i]->dtype != dt) {
            PyErr_Format(PyExc_TypeError, "op_ewise: operands of dtypes %s and %s (convert first)",
                         ct_dtype_name(as.b[i]->dtype), ct_dtype_name(bs.b[i]->dtype));
            goto out;
        }
        if (!ct_ewise_supported(op, dt)) {
            PyErr_Format(PyExc_TypeError, "op_ewise: op %d does not accept dtype %s", op,
                         ct_dtype_name((ct_dtype)dt));
            goto out;
        }
        if ((int)os.b[i]->dtype != ct_ewise_out_dtype(op, dt)) {
            PyErr_Format(PyExc_TypeError, "op_ewise: output of dtype %s where %s is needed",
                         ct_dtype_name(os.b[i]->dtype),
                         ct_dtype_name((ct_dtype)ct_ewise_out_dtype(op, dt)));
            goto out;
        }
    }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < os.n && st == CT_OK; i++) {
        ct_py_buffer *o = os.b[i], *a = as.b[i], *b = unary ? as.b[i] : bs.b[i];
        int64_t sa[CT_MAX_NDIM], sb[CT_MAX_NDIM];
        if (a->dev != o->dev || b->dev != o->dev) {
            st = ct_set_error(CT_EINVAL, "op_ewise: operands of one shard live on different devices");
            break;
        }
        st = ct_broadcast_strides(o->ndim, o->shape, a->ndim, a->shape, sa);
        if (st == CT_OK) st = ct_broadcast_strides(o->ndim, o->shape, b->ndim, b->shape, sb);
        if (st == CT_OK)
            st = ct_op_ewise(o->dev, op, (int)a->dtype, o->ndim, o->shape, o->data, a->data, sa,
                             b->data, sb);
    }
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&os);
    put_buffers(&as);
    put_buffers(&bs);
    return ret;
}

/* outs[i] = the wrapping sum (op 0) or maximum (op 1) of the int32 / uint32 / bool shard
 * xs[i] over the dims in the bit mask, in its dtype. */
static PyObject *py_op_reduce_typed(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *oo;
    uint32_t axes;
    int op;
    if (!PyArg_ParseTuple(args, "OiO&O:op_reduce_typed", &xo, &op, ct_py_conv_u32, &axes, &oo))
        return NULL;
    if (op < 0 || op >= CT_RED_COUNT) {
        PyErr_Format(PyExc_ValueError, "op_reduce_typed: unknown reduction %d", op);
        return NULL;
    }
    PyObject *ret = NULL;
    BUF_LIST(xs);
    BUF_LIST(os);
    if (get_buffers(xo, &xs, "op_reduce_typed input", 0) < 0 ||
        get_buffers(oo, &os, "op_reduce_typed output", 0) < 0 ||
        same_len(&xs, &os, "op_reduce_typed") < 0)
        goto out;
    for (Py_ssize_t i = 0; i < xs.n; i++) {
        if (axes_outside(axes, xs.b[i]->ndim, "op_reduce_typed") < 0) goto out;
        int64_t want = 1;
        for (int d = 0; d < xs.b[i]->ndim; d++)
            if (!(axes & (1u << d))) want *= xs.b[i]->shape[d];
        if (os.b[i]->dtype != xs.b[i]->dtype) {
            PyErr_SetString(PyExc_TypeError, "op_reduce_typed: output dtype differs from the input's");
            goto out;
        }
        if (nelem(os.b[i]) != want || os.b[i]->dev != xs.b[i]->dev) {
            PyErr_SetString(PyExc_ValueError, "op_reduce_typed: output shard has the wrong size");
            goto out;
        }
    }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < xs.n && st == CT_OK; i++)
        st = ct_op_reduce_typed(xs.b[i]->dev, op, (int)xs.b[i]->dtype, xs.b[i]->ndim,
                                xs.b[i]->shape, axes, xs.b[i]->data, os.b[i]->data);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&xs);
    put_buffers(&os);
    return ret;
}

static PyObject *py_op_reduce(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *oo;
    uint32_t axes;
    int op;
    if (!PyArg_ParseTuple(args, "OiO&O:op_reduce", &xo, &op, ct_py_conv_u32, &axes, &oo))
        return NULL;
    if (op < 0 || op >= CT_RED_COUNT) {
        PyErr_Format(PyExc_ValueError, "op_reduce: unknown reduction %d", op);
        return NULL;
    }
    PyObject *ret = NULL;
    BUF_LIST(xs);
    BUF_LIST(os);
    if (get_buffers(xo, &xs, "op_reduce input", 1) < 0 ||
        get_buffers(oo, &os, "op_reduce output", 1) < 0 || same_len(&xs, &os, "op_reduce") < 0)
        goto out;
    for (Py_ssize_t i = 0; i < xs.n; i++) {
        if (axes_outside(axes, xs.b[i]->ndim, "op_reduce") < 0) goto out;
        int64_t want = 1;
        for (int d = 0; d < xs.b[i]->ndim; d++)
            if (!(axes & (1u << d))) want *= xs.b[i]->shape[d];
        if (nelem(os.b[i]) != want || os.b[i]->dev != xs.b[i]->dev) {
            PyErr_SetString(PyExc_ValueError, "op_reduce: output shard has the wrong size");
            goto out;
        }
    }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < xs.n && st == CT_OK; i++)
        st = ct_op_reduce(xs.b[i]->dev, op, xs.b[i]->ndim, xs.b[i]->shape, axes, xs.b[i]->data,
                          os.b[i]->data);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&xs);
    put_buffers(&os);
    return ret;
}

/* *out = a * b * c for non-negative operands; -1 when that overflows int64. */
static int mul3(int64_t a, int64_t b, int64_t c, int64_t *out) {
    int64_t t;
    if (__builtin_mul_overflow(a, b, &t) || __builtin_mul_overflow(t, c, out)) return -1;
    return 0;
}

/* Elements `batch` (>= 1) rows x cols matrices `stride` apart span: (batch - 1) * stride +
 * rows * cols; -1 when that overflows int64. */
static int span(int64_t batch, int64_t stride, int64_t rows, int64_t cols, int64_t *out) {
    int64_t a, b;
    if (__builtin_mul_overflow(batch - 1, stride, &a) || __builtin_mul_overflow(rows, cols, &b) ||
        __builtin_add_overflow(a, b, out))
        return -1;
    return 0;
}

/* Products of one chunk of a batched matmul: about this many multiply-adds (at least one
 * product) run between two looks at Python's signal flag, so that Ctrl-C stops a long
 * batch within a fraction of a second. */
#define MATMUL_CHUNK_MACS ((int64_t)1 << 26)

/* Batched matmul over shards: for every shard, `batch` products
 * C[b] (m x n) = alpha * op(A[b]) op(B[b]) + beta * C[b]; a zero batch stride
 * broadcasts an operand over the batch. `prec`: CT_PREC_* (ct_prec_math.h).
 * An empty C (m or n zero) returns at once, whatever the batch; a long batch runs in
 * chunks with the GIL released, and a pending signal (KeyboardInterrupt) stops it between
 * two chunks. */
static PyObject *py_op_matmul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ao, *bo, *co;
    long long batch, m, n, k, sa, sb;
    int ta, tb, prec = CT_PREC_F32;
    float alpha, beta;
    if (!PyArg_ParseTuple(args, "OOOLLLLLLiiff|i:op_matmul", &ao, &bo, &co, &batch, &m, &n, &k,
                          &sa, &sb, &ta, &tb, &alpha, &beta, &prec))
        return NULL;
    if (prec < 0 || prec >= CT_PREC_COUNT) {
        PyErr_Format(PyExc_ValueError, "op_matmul: unknown precision code %d", prec);
        return NULL;
    }
    if (batch < 0 || m < 0 || n < 0 || k < 0 || sa < 0 || sb < 0) {
        PyErr_Format(PyExc_ValueError,
                     "op_matmul: negative size or batch stride (batch %lld, m %lld, n %lld, "
                     "k %lld, strides %lld, %lld)", batch, m, n, k, sa, sb);
        return NULL;
    }
    /* elements each operand spans, without int64 overflow (a wrapped product passed the
     * size check and the kernel then read and wrote outside the buffers) */
    int64_t need_a, need_b, need_c;
    if (batch > 0 && (span(batch, sa, m, k, &need_a) < 0 || span(batch, sb, k, n, &need_b) < 0 ||
                      mul3(batch, m, n, &need_c) < 0)) {
        PyErr_SetString(PyExc_ValueError, "op_matmul: the operand sizes overflow int64");
        return NULL;
    }
    if (batch == 0) need_a = need_b = need_c = 0;
    PyObject *ret = NULL;
    BUF_LIST(as);
    BUF_LIST(bs);
    BUF_LIST(cs);
    if (get_buffers(ao, &as, "matmul lhs", 1) < 0 || get_buffers(bo, &bs, "matmul rhs", 1) < 0 ||
        get_buffers(co, &cs, "matmul out", 1) < 0 || same_len(&as, &bs, "matmul") < 0 ||
        same_len(&as, &cs, "matmul") < 0)
        goto out;
    for (Py_ssize_t i = 0; i < as.n; i++) {
        if (nelem(cs.b[i]) < need_c || nelem(as.b[i]) < need_a || nelem(bs.b[i]) < need_b ||
            as.b[i]->dev != cs.b[i]->dev || bs.b[i]->dev != cs.b[i]->dev) {
            PyErr_SetString(PyExc_ValueError, "matmul: shard sizes do not match the product");
            goto out;
        }
    }
    if (m == 0 || n == 0) batch = 0; /* C is empty: nothing to compute or write */
    /* products per chunk: m * n * max(k, 1) multiply-adds each (no overflow: m * n <= the
     * elements of C, and k < 2**63) */
    int64_t macs = 1;
    if (batch > 0 && __builtin_mul_overflow((int64_t)m * n, k > 0 ? k : 1, &macs))
        macs = INT64_MAX;
    const int64_t chunk = macs >= MATMUL_CHUNK_MACS ? 1 : MATMUL_CHUNK_MACS / macs;
    ct_status st = CT_OK;
    for (Py_ssize_t i = 0; i < as.n && st == CT_OK; i++) {
        const float *a = as.b[i]->data, *b = bs.b[i]->data;
        float *c = cs.b[i]->data;
        ct_device *dev = cs.b[i]->dev;
        for (int64_t t0 = 0; t0 < batch && st == CT_OK; t0 += chunk) {
            const int64_t t1 = batch - t0 < chunk ? batch : t0 + chunk;
            if (t0 > 0 && PyErr_CheckSignals() < 0) goto out;
            Py_BEGIN_ALLOW_THREADS
            for (int64_t t = t0; t < t1 && st == CT_OK; t++)
                st = ct_op_gemm(dev, ta, tb, m, n, k, alpha, a + t * sa, ta ? m : k, b + t * sb,
                                tb ? k : n, beta, c + t * m * n, n, prec);
            Py_END_ALLOW_THREADS
        }
    }
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&as);
    put_buffers(&bs);
    put_buffers(&cs);
    return ret;
}

/* A group of an all-reduce: at least one shard, all of one size and one backend. */
static int allreduce_group_check(const buf_list *bl) {
    if (bl->n == 0) {
        PyErr_SetString(PyExc_ValueError, "all-reduce: a group has no shards");
        return -1;
    }
    for (Py_ssize_t i = 0; i < bl->n; i++) {
        if (bl->b[i]->nbytes != bl->b[0]->nbytes) {
            PyErr_SetString(PyExc_ValueError, "all-reduce: shards of a group differ in size");
            return -1;
        }
        if (bl->b[i]->dev->backend != bl->b[0]->dev->backend) {
            PyErr_SetString(PyExc_ValueError, "all-reduce: a group spans different backends");
            return -1;
        }
    }
    return 0;
}

/* Every group is checked before any is reduced: a bad group leaves all shards as they were. */
static PyObject *py_op_allreduce(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arg;
    int op = CT_RED_SUM;
    if (!PyArg_ParseTuple(args, "O|i:op_allreduce", &arg, &op)) return NULL;
    if (op < 0 || op >= CT_RED_COUNT) {
        PyErr_Format(PyExc_ValueError, "op_allreduce: unknown reduction %d", op);
        return NULL;
    }
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "op_allreduce needs a list of groups, got %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    PyObject *groups = PySequence_Tuple(arg); /* fixed while the GIL is released below */
    if (groups == NULL) return NULL;
    const Py_ssize_t ng = PyTuple_GET_SIZE(groups);
    for (int run = 0; run < 2; run++) { /* run 0 checks every group, run 1 reduces them */
        for (Py_ssize_t g = 0; g < ng; g++) {
            BUF_LIST(bl);
            if (get_buffers(PyTuple_GET_ITEM(groups, g), &bl, "all-reduce group", 1) < 0 ||
                allreduce_group_check(&bl) < 0) {
                put_buffers(&bl);
                Py_DECREF(groups);
                return NULL;
            }
            if (run == 0) {
                put_buffers(&bl);
                continue;
            }
            ct_device *devs[MAX_SHARDS];
            float *bufs[MAX_SHARDS];
            f32_blocks(&bl, devs, bufs);
            ct_status st;
            Py_BEGIN_ALLOW_THREADS
            st = ct_op_allreduce(devs, bufs, (int)bl.n, nelem(bl.b[0]), op);
            Py_END_ALLOW_THREADS
            put_buffers(&bl);
            if (st != CT_OK) {
                Py_DECREF(groups);
                return ct_py_raise(st);
            }
        }
    }
    Py_DECREF(groups);
    Py_RETURN_NONE;
}

/* NCCL across processes: op_nccl_unique_id(buf) -> bytes (None when buf's backend has no
 * such engine); op_allreduce_ranks(bufs, op, id, nranks, ranks). */
static PyObject *py_op_nccl_unique_id(PyObject *self, PyObject *arg) {
    (void)self;
    ct_py_buffer *b = ct_py_buffer_check(arg, "op_nccl_unique_id");
    if (b == NULL) return NULL;
    if (!ct_op_has_allreduce_ranks(b->dev)) Py_RETURN_NONE;
    unsigned char id[CT_NCCL_ID_BYTES];
    ct_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ct_op_nccl_unique_id(b->dev, id);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) return ct_py_raise(st);
    return PyBytes_FromStringAndSize((const char *)id, CT_NCCL_ID_BYTES);
}

static PyObject *py_op_allreduce_ranks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bo, *ro;
    int op, nranks;
    Py_buffer id;
    if (!PyArg_ParseTuple(args, "Oiy*iO:op_allreduce_ranks", &bo, &op, &id, &nranks, &ro))
        return NULL;
    PyObject *ret = NULL;
    BUF_LIST(bl);
    int ranks[MAX_SHARDS];
    if (id.len != CT_NCCL_ID_BYTES) {
        PyErr_Format(PyExc_ValueError, "op_allreduce_ranks: an id of %zd bytes (not %d)", id.len,
                     CT_NCCL_ID_BYTES);
        goto out;
    }
    if (get_buffers(bo, &bl, "all-reduce group", 1) < 0) goto out;
    if (allreduce_group_check(&bl) < 0) goto out;
    PyObject *rf = PySequence_Fast(ro, "op_allreduce_ranks: ranks");
    if (rf == NULL) goto out;
    if (PySequence_Fast_GET_SIZE(rf) != bl.n) {
        Py_DECREF(rf);
        PyErr_SetString(PyExc_ValueError, "op_allreduce_ranks: a rank per buffer");
        goto out;
    }
    for (Py_ssize_t i = 0; i < bl.n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(rf, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(rf);
            goto out;
        }
        ranks[i] = (int)v;
    }
    Py_DECREF(rf);
    {
        ct_device *devs[MAX_SHARDS];
        float *bufs[MAX_SHARDS];
        f32_blocks(&bl, devs, bufs);
        ct_status st;
        Py_BEGIN_ALLOW_THREADS
        st = ct_op_allreduce_ranks(devs, bufs, (int)bl.n, nelem(bl.b[0]), op,
                                   (const unsigned char *)id.buf, nranks, ranks);
        Py_END_ALLOW_THREADS
        if (st != CT_OK) ct_py_raise(st);
        else ret = Py_NewRef(Py_None);
    }
out:
    put_buffers(&bl);
    PyBuffer_Release(&id);
    return ret;
}

/* Row gathers / scatter-adds over shards: tables[i] (2-d float32 block of global rows
 * row0s[i] ..), rows[i] (float32, n x ncols), and on the same device int32 indices: for a
 * gather the n ids; for a scatter-add the ids grouped by row, one buffer
 * [hit (nhit) | start (nhit + 1) | pos (n)] (ct_op_scatter_add_rows).
 * A gather given `words` >= 1 moves rows of that many 32-bit words whatever the buffers'
 * dtypes and shapes: a table is then any dense buffer of a whole number of such rows and
 * rows[i] holds n of them (bytes are copied, so any dtype moves bit for bit). */
static PyObject *rows_op(PyObject *args, int scatter) {
    const char *what = scatter ? "op_scatter_add_rows" : "op_gather_rows";
    PyObject *to, *io, *ro, *oo;
    Py_ssize_t nhit = 0, words = 0;
    if (scatter ? !PyArg_ParseTuple(args, "OOOOn", &to, &io, &ro, &oo, &nhit)
                : !PyArg_ParseTuple(args, "OOOO|n", &to, &io, &ro, &oo, &words))
        return NULL;
    if (nhit < 0 || words < 0) {
        PyErr_Format(PyExc_ValueError, "%s: negative %s", what, nhit < 0 ? "row count" : "row width");
        return NULL;
    }
    if (words > INT32_MAX || nhit > INT32_MAX) { /* rows are int32-indexed; no size overflows */
        PyErr_Format(PyExc_ValueError, "%s: %s %zd is out of range", what,
                     words > INT32_MAX ? "row width" : "row count",
                     words > INT32_MAX ? words : nhit);
        return NULL;
    }
    /* the row offsets first: reading them may run Python code (__index__) */
    PyObject *offs = PySequence_Fast(oo, "row offsets must be a sequence of ints");
    if (offs == NULL) return NULL;
    const Py_ssize_t noffs = PySequence_Fast_GET_SIZE(offs);
    if (noffs > MAX_SHARDS) {
        Py_DECREF(offs);
        PyErr_Format(PyExc_ValueError, "%s: too many row offsets", what);
        return NULL;
    }
    int64_t row0[MAX_SHARDS];
    for (Py_ssize_t i = 0; i < noffs; i++) {
        PyObject *idx = PyNumber_Index(PySequence_Fast_GET_ITEM(offs, i));
        row0[i] = idx == NULL ? -1 : PyLong_AsLongLong(idx);
        Py_XDECREF(idx);
        if (row0[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(offs);
            return NULL;
        }
    }
    Py_DECREF(offs);
    PyObject *ret = NULL;
    BUF_LIST(ts);
    BUF_LIST(is);
    BUF_LIST(rs);
    const int f32 = words == 0; /* rows of words: any dtype */
    if (get_buffers(to, &ts, what, f32) < 0 || get_buffers(io, &is, what, 0) < 0 ||
        get_buffers(ro, &rs, what, f32) < 0 || same_len(&ts, &is, what) < 0 ||
        same_len(&ts, &rs, what) < 0)
        goto out;
    if (noffs != ts.n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd row offsets for %zd shards", what, noffs, ts.n);
        goto out;
    }
    for (Py_ssize_t i = 0; i < ts.n; i++) {
        const ct_py_buffer *t = ts.b[i], *id = is.b[i], *r = rs.b[i];
        if (words > 0) { /* rows of `words` 32-bit words: sizes in bytes */
            const int64_t n = nelem(id), rb = 4 * (int64_t)words;
            int64_t rbytes;
            if (id->dtype != CT_I32 || t->dev != id->dev || t->dev != r->dev ||
                t->nbytes % (size_t)rb != 0 || __builtin_mul_overflow(n, rb, &rbytes) ||
                r->nbytes != (size_t)rbytes) {
                PyErr_Format(PyExc_ValueError, "%s: shard %zd: need a table of whole rows of "
                             "%zd words, int32 ids and len(ids) rows out, on one device", what,
                             i, words);
                goto out;
            }
            continue;
        }
        const int64_t nc = t->ndim == 2 ? t->shape[1] : 0;
        const int64_t n = scatter ? (nc > 0 ? nelem(r) / nc : 0) : nelem(id);
        const int64_t nidx = scatter ? 2 * (int64_t)nhit + 1 + n : n;
        if (t->ndim != 2 || id->dtype != CT_I32 || t->dev != id->dev || t->dev != r->dev ||
            nelem(r) != n * nc || nelem(id) != nidx) {
            PyErr_Format(PyExc_ValueError, "%s: shard %zd: need a 2-d table, int32 ids and rows "
                         "of len(ids) x columns on one device", what, i);
            goto out;
        }
    }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < ts.n && st == CT_OK; i++) {
        const ct_py_buffer *t = ts.b[i];
        const int32_t *idx = is.b[i]->data;
        if (scatter)
            st = ct_op_scatter_add_rows(t->dev, t->data, t->shape[0], t->shape[1], row0[i], idx,
                                        idx + nhit, (int64_t)nhit, idx + 2 * nhit + 1,
                                        nelem(is.b[i]) - 2 * (int64_t)nhit - 1, rs.b[i]->data);
        else if (words > 0)
            st = ct_op_gather_rows(t->dev, t->data, (int64_t)(t->nbytes / (4 * (size_t)words)),
                                   (int64_t)words, row0[i], is.b[i]->data, nelem(is.b[i]),
                                   rs.b[i]->data);
        else
            st = ct_op_gather_rows(t->dev, t->data, t->shape[0], t->shape[1], row0[i],
                                   is.b[i]->data, nelem(is.b[i]), rs.b[i]->data);
    }
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&ts);
    put_buffers(&is);
    put_buffers(&rs);
    return ret;
}

static PyObject *py_op_gather_rows(PyObject *self, PyObject *args) {
    (void)self;
    return rows_op(args, 0);
}

static PyObject *py_op_scatter_add_rows(PyObject *self, PyObject *args) {
    (void)self;
    return rows_op(args, 1);
}

static PyObject *py_op_transpose(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo, *po;
    if (!PyArg_ParseTuple(args, "OOO:op_transpose", &xo, &po, &yo)) return NULL;
    /* the permutation first: reading it may run Python code (__index__) */
    int64_t perm64[CT_MAX_NDIM];
    int np_ = ct_py_int64_seq(po, perm64, CT_MAX_NDIM, "perm");
    if (np_ < 0) return NULL;
    int perm[CT_MAX_NDIM];
    for (int i = 0; i < np_; i++) {
        if (perm64[i] < 0 || perm64[i] >= np_) {
            PyErr_Format(PyExc_ValueError, "transpose: axis %lld is out of range for rank %d",
                         (long long)perm64[i], np_);
            return NULL;
        }
        perm[i] = (int)perm64[i];
    }
    PyObject *ret = NULL;
    BUF_LIST(xs);
    BUF_LIST(ys);
    if (get_buffers(xo, &xs, "transpose input", 0) < 0 || get_buffers(yo, &ys, "transpose output", 0) < 0 ||
        same_len(&xs, &ys, "transpose") < 0)
        goto out;
    for (Py_ssize_t i = 0; i < xs.n; i++)
        if (xs.b[i]->ndim != np_ || xs.b[i]->nbytes != ys.b[i]->nbytes ||
            xs.b[i]->dtype != ys.b[i]->dtype || xs.b[i]->dev != ys.b[i]->dev) {
            PyErr_SetString(PyExc_ValueError, "transpose: shard shapes do not match");
            goto out;
        }
    ct_status st = CT_OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < xs.n && st == CT_OK; i++)
        st = ct_op_transpose(xs.b[i]->dev, np_, xs.b[i]->shape, perm, ct_dtype_size(xs.b[i]->dtype),
                             xs.b[i]->data, ys.b[i]->data);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) ct_py_raise(st);
    else ret = Py_NewRef(Py_None);
out:
    put_buffers(&xs);
    put_buffers(&ys);
    return ret;
}

static PyObject *py_set_blas_sgemm(PyObject *self, PyObject *arg) {
    (void)self;
    if (arg == Py_None) {
        ct_set_blas_sgemm(NULL);
        Py_RETURN_NONE;
    }
    if (!PyCapsule_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_blas_sgemm needs a PyCapsule holding sgemm or None");
        return NULL;
    }
    /* Cython names a capsule by the C signature of what it holds: only a Fortran-ABI sgemm
     * (scipy.linalg.cython_blas's, 13 pointer parameters) is called through this pointer */
    static const char sig[] = "void (char *, char *, int *, int *, int *, ";
    const char *name = PyCapsule_GetName(arg);
    if (name == NULL && PyErr_Occurred()) return NULL;
    int commas = 0;
    for (const char *q = name; q != NULL && *q; q++) commas += *q == ',';
    if (name == NULL || strncmp(name, sig, sizeof sig - 1) != 0 || commas != 12) {
        PyErr_Format(PyExc_TypeError, "set_blas_sgemm: the capsule (named %s) does not hold a "
                     "Fortran-ABI sgemm such as scipy.linalg.cython_blas's",
                     name ? name : "NULL");
        return NULL;
    }
    void *p = PyCapsule_GetPointer(arg, name);
    if (p == NULL) return NULL;
    ct_sgemm_fn fn;
    memcpy(&fn, &p, sizeof fn);
    ct_set_blas_sgemm(fn);
    Py_RETURN_NONE;
}

static PyObject *py_gemm_small(PyObject *self, PyObject *args) {
    (void)self;
    long long n, k;
    if (!PyArg_ParseTuple(args, "LL:gemm_small", &n, &k)) return NULL;
    if (n < 0 || k < 0) {
        PyErr_Format(PyExc_ValueError, "gemm_small: negative size (n %lld, k %lld)", n, k);
        return NULL;
    }
    return PyBool_FromLong(ct_cpu_gemm_small((int64_t)n, (int64_t)k));
}

static PyObject *py_has_blas(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyBool_FromLong(ct_get_blas_sgemm() != NULL);
}

static PyMethodDef ops_methods[] = {
    {"op_convert", py_op_convert, METH_VARARGS,
     "op_convert($module, xs, ys, /)\n--\n\nys[i] = xs[i] converted to ys[i]'s dtype (jax's "
     "convert_element_type), for every shard."},
    {"op_unary", py_op_unary, METH_VARARGS,
     "op_unary($module, op, alpha, beta, xs, ys, /)\n--\n\nys[i] = op(xs[i]) for every shard."},
    {"fill_bits32", py_fill_bits32, METH_VARARGS,
     "fill_bits32($module, buffers, bits, /)\n--\n\nSet every 4-byte element of each buffer "
     "to the 32-bit pattern `bits` (a kernel on the buffer's device)."},
    {"op_binary", py_op_binary, METH_VARARGS,
     "op_binary($module, op, outs, lhs, rhs, /)\n--\n\nouts[i] = lhs[i] op rhs[i] with numpy "
     "broadcasting of the shard shapes."},
    {"op_ewise", py_op_ewise, METH_VARARGS,
     "op_ewise($module, op, outs, lhs, rhs, /)\n--\n\nouts[i] = op(lhs[i], rhs[i]) (comparisons, "
     "booleans, integer arithmetic: ct_ewise_math.h) with numpy broadcasting of the shard "
     "shapes; rhs None for a unary op. Operands share one dtype; outputs are bool for "
     "comparisons and is* tests, else of that dtype."},
    {"op_reduce_typed", py_op_reduce_typed, METH_VARARGS,
     "op_reduce_typed($module, xs, op, axes_mask, outs, /)\n--\n\nReduce every int32 / uint32 "
     "/ bool shard over the axes in the bit mask, in its dtype: op 0 sums (wrapping), 1 takes "
     "the maximum."},
    {"op_reduce", py_op_reduce, METH_VARARGS,
     "op_reduce($module, xs, op, axes_mask, outs, /)\n--\n\nReduce every shard over the axes in "
     "the bit mask: op 0 sums, 1 takes the maximum (NaN wins)."},
    {"op_matmul", py_op_matmul, METH_VARARGS,
     "op_matmul($module, a, b, c, batch, m, n, k, a_batch_stride, b_batch_stride, trans_a, "
     "trans_b, alpha, beta, precision=0, /)\n--\n\nBatched GEMM on every shard; precision: 0 "
     "float32, 1 TF32 inputs, 2 bfloat16 inputs (float32 accumulation)."},
    {"op_allreduce", py_op_allreduce, METH_VARARGS,
     "op_allreduce($module, groups, op=0, /)\n--\n\nIn every group of shards, replace each shard "
     "by the sum (op 0) or the maximum (op 1) of the group."},
    {"op_nccl_unique_id", py_op_nccl_unique_id, METH_O,
     "op_nccl_unique_id($module, buf, /)\n--\n\nA new ncclUniqueId (bytes) from buf's backend, "
     "or None where that backend has no NCCL across processes."},
    {"op_allreduce_ranks", py_op_allreduce_ranks, METH_VARARGS,
     "op_allreduce_ranks($module, bufs, op, id, nranks, ranks, /)\n--\n\nAll-reduce (in place, "
     "sum op 0 or max op 1) of this process's members bufs of a group spanning processes, "
     "through the NCCL communicator of `id`: ranks[i] is bufs[i]'s GPU's rank of nranks."},
    {"op_gather_rows", py_op_gather_rows, METH_VARARGS,
     "op_gather_rows($module, tables, ids, outs, row0s, words=0, /)\n--\n\nFor every shard: out[i] = "
     "table[ids[i] - row0] when that row is in the shard's block, else 0. words >= 1: rows "
     "of that many 32-bit words, the buffers of any dtype and shape (bytes are moved)."},
    {"op_scatter_add_rows", py_op_scatter_add_rows, METH_VARARGS,
     "op_scatter_add_rows($module, tables, plans, gs, row0s, nhit, /)\n--\n\nFor every shard: "
     "table[hit[u] - row0] += g[pos[k]] for k in [start[u], start[u + 1]), rows in the shard's "
     "block only; plan = int32 [hit (nhit) | start (nhit + 1) | pos]."},
    {"op_transpose", py_op_transpose, METH_VARARGS,
     "op_transpose($module, xs, perm, ys, /)\n--\n\nTranspose every shard."},
    {"set_blas_sgemm", py_set_blas_sgemm, METH_O,
     "set_blas_sgemm($module, capsule, /)\n--\n\nUse this Fortran-ABI sgemm (e.g. scipy's) for "
     "CPU matmuls; None restores the built-in kernel."},
    {"gemm_small", py_gemm_small, METH_VARARGS,
     "gemm_small($module, n, k, /)\n--\n\nWhether a CPU product whose right operand (after its "
     "transpose) is k x n runs the small register-blocked kernel, never the BLAS sgemm."},
    {"has_blas", py_has_blas, METH_NOARGS,
     "has_blas($module, /)\n--\n\nWhether an optimized BLAS sgemm is registered."},
    {NULL, NULL, 0, NULL},
};

/* _C.op_codes: {"unary": {name: code}, "binary": ..., "ewise": ..., "reduce": ...,
 * "precision": ...}, the ct_ops.h (and ct_prec_math.h) enums by their names without the prefix: the Python layer reads the kernels'
 * codes here instead of copying them. */
#define NAMED(prefix, x) {#x, prefix##x}
typedef struct {
    const char *name;
    int code;
} named_code;

static const named_code unary_codes[] = {
    NAMED(CT_UN_, AFFINE), NAMED(CT_UN_, NEG), NAMED(CT_UN_, SIN), NAMED(CT_UN_, COS),
    NAMED(CT_UN_, TANH), NAMED(CT_UN_, RELU), NAMED(CT_UN_, STEP), NAMED(CT_UN_, GELU),
    NAMED(CT_UN_, GELU_GRAD), NAMED(CT_UN_, EXP), NAMED(CT_UN_, LOG), NAMED(CT_UN_, SQRT),
    NAMED(CT_UN_, RSQRT), NAMED(CT_UN_, SQUARE), NAMED(CT_UN_, SIGMOID), NAMED(CT_UN_, ABS),
    NAMED(CT_UN_, SIGN), NAMED(CT_UN_, POW), NAMED(CT_UN_, RDIV), NAMED(CT_UN_, LOG1P),
    NAMED(CT_UN_, EXPM1), NAMED(CT_UN_, ERF), NAMED(CT_UN_, FLOOR), NAMED(CT_UN_, CEIL),
    NAMED(CT_UN_, ROUND), NAMED(CT_UN_, TRUNC), NAMED(CT_UN_, ERFC), NAMED(CT_UN_, SINH),
    NAMED(CT_UN_, COSH), NAMED(CT_UN_, TAN), NAMED(CT_UN_, ASIN), NAMED(CT_UN_, ACOS),
    NAMED(CT_UN_, ATAN), NAMED(CT_UN_, ASINH), NAMED(CT_UN_, ACOSH), NAMED(CT_UN_, ATANH),
    NAMED(CT_UN_, CBRT), NAMED(CT_UN_, EXP2), NAMED(CT_UN_, SIGNBIT),
};
_Static_assert(sizeof unary_codes / sizeof unary_codes[0] == CT_UN_COUNT, "every unary op named");

static const named_code binary_codes[] = {
    NAMED(CT_BIN_, ADD), NAMED(CT_BIN_, SUB), NAMED(CT_BIN_, MUL), NAMED(CT_BIN_, DIV),
    NAMED(CT_BIN_, MAX), NAMED(CT_BIN_, MIN), NAMED(CT_BIN_, GT), NAMED(CT_BIN_, KEEP),
    NAMED(CT_BIN_, POW), NAMED(CT_BIN_, ATAN2), NAMED(CT_BIN_, NEXTAFTER), NAMED(CT_BIN_, FMOD),
    NAMED(CT_BIN_, LDEXP), NAMED(CT_BIN_, PICK),
};
_Static_assert(sizeof binary_codes / sizeof binary_codes[0] == CT_BIN_COUNT, "every binary op named");

static const named_code ewise_codes[] = {
    NAMED(CT_EW_, EQ), NAMED(CT_EW_, NE), NAMED(CT_EW_, LT), NAMED(CT_EW_, LE),
    NAMED(CT_EW_, GT), NAMED(CT_EW_, GE), NAMED(CT_EW_, ADD), NAMED(CT_EW_, SUB),
    NAMED(CT_EW_, MUL), NAMED(CT_EW_, MAX), NAMED(CT_EW_, MIN), NAMED(CT_EW_, FLOORDIV),
    NAMED(CT_EW_, REM), NAMED(CT_EW_, AND), NAMED(CT_EW_, OR), NAMED(CT_EW_, XOR),
    NAMED(CT_EW_, SHL), NAMED(CT_EW_, SHR), NAMED(CT_EW_, NOT), NAMED(CT_EW_, NEG),
    NAMED(CT_EW_, ABS), NAMED(CT_EW_, ISNAN), NAMED(CT_EW_, ISINF), NAMED(CT_EW_, ISFINITE),
};
_Static_assert(sizeof ewise_codes / sizeof ewise_codes[0] == CT_EW_COUNT, "every typed op named");

static const named_code reduce_codes[] = {NAMED(CT_RED_, SUM), NAMED(CT_RED_, MAX)};
static const named_code precision_codes[] = {NAMED(CT_PREC_, F32), NAMED(CT_PREC_, TF32),
                                             NAMED(CT_PREC_, BF16)};
_Static_assert(sizeof reduce_codes / sizeof reduce_codes[0] == CT_RED_COUNT, "every reduction named");

static PyObject *codes_dict(const named_code *c, size_t n) {
    PyObject *d = PyDict_New();
    for (size_t i = 0; d != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(c[i].code);
        if (v == NULL || PyDict_SetItemString(d, c[i].name, v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

#define CODES(a) codes_dict(a, sizeof a / sizeof a[0])

int ct_py_init_ops(PyObject *m) {
    if (PyModule_AddFunctions(m, ops_methods) < 0) return -1;
    PyObject *u = CODES(unary_codes), *b = CODES(binary_codes), *e = CODES(ewise_codes),
             *r = CODES(reduce_codes), *p = CODES(precision_codes);
    PyObject *all = (u && b && e && r && p)
                        ? Py_BuildValue("{sOsOsOsOsO}", "unary", u, "binary", b, "ewise", e,
                                        "reduce", r, "precision", p)
                        : NULL;
    Py_XDECREF(p);
    Py_XDECREF(u);
    Py_XDECREF(b);
    Py_XDECREF(e);
    Py_XDECREF(r);
    if (all == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "op_codes", all);
    Py_DECREF(all);
    return rc;
}
