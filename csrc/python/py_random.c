/*
 * py_random.c — bindings of the PRNG core (csrc/core/ct_threefry.h,
 * ct_random.h): key split / fold_in, block fills, and draws under arrays of keys into a device Buffer or a
 * C-contiguous numpy array. GPU Buffers are filled by their backend's kernel
 * (ct_random_fill_block_device), bit-identical to the host fill. Argument parsing and buffer checks only; the GIL
 * is released around every fill.
 */
#include "ct_py.h"

#include "../core/ct_random.h"
#include "../core/ct_threefry.h"

/* --- output targets -------------------------------------------------------- */

typedef struct {
    void *data;
    ct_device *dev; /* the device owning a Buffer target with a random kernel; else NULL */
    int ndim;
    int64_t shape[CT_RANDOM_MAX_NDIM];
    size_t itemsize;
    ct_py_buffer *pinned; /* a Buffer target, pinned (ct_py_pin) until put_target */
} out_target;

static void put_target(out_target *t) {
    if (t->pinned != NULL) ct_py_unpin(t->pinned);
    t->pinned = NULL;
}

/* A writable destination: a live _C.Buffer (CPU memory, or GPU memory when
 * `device_ok` and its backend has a random kernel) or a C-contiguous,
 * aligned, writeable, native-order numpy array. */
static int get_target(PyObject *obj, out_target *t, const char *what, int device_ok) {
    t->dev = NULL;
    t->pinned = NULL;
    if (PyObject_TypeCheck(obj, &ct_py_BufferType)) {
        ct_py_buffer *b = ct_py_buffer_check(obj, what);
        if (b == NULL) return -1;
        if (b->dev->platform != CT_PLATFORM_CPU && device_ok &&
            ct_random_device_supported(b->dev)) {
            t->dev = b->dev;
        } else if (b->dev->platform != CT_PLATFORM_CPU) {
            PyErr_Format(PyExc_TypeError,
                         "%s: a GPU buffer cannot be filled from the host; fill a host block "
                         "and copy it (ctrainstate.array._fill_array does)", what);
            return -1;
        }
        if (b->ndim > CT_RANDOM_MAX_NDIM) {
            PyErr_Format(PyExc_ValueError, "%s: rank %d is too large", what, b->ndim);
            return -1;
        }
        t->data = b->data;
        t->ndim = b->ndim;
        memcpy(t->shape, b->shape, sizeof(int64_t) * (size_t)b->ndim);
        t->itemsize = ct_dtype_size(b->dtype);
        ct_py_pin(b);
        t->pinned = b;
        return 0;
    }
    if (PyArray_Check(obj)) {
        PyArrayObject *a = (PyArrayObject *)obj;
        if (PyDataType_REFCHK(PyArray_DESCR(a))) {
            PyErr_Format(PyExc_TypeError, "%s: an array of Python objects cannot hold random "
                         "numbers", what);
            return -1;
        }
        if (!PyArray_ISCARRAY(a) || !PyArray_ISNOTSWAPPED(a)) {
            PyErr_Format(PyExc_ValueError,
                         "%s must be a C-contiguous, aligned, writeable, native-order array",
                         what);
            return -1;
        }
        if (PyArray_NDIM(a) > CT_RANDOM_MAX_NDIM) {
            PyErr_Format(PyExc_ValueError, "%s: rank %d is too large", what, PyArray_NDIM(a));
            return -1;
        }
        t->data = PyArray_DATA(a);
        t->ndim = PyArray_NDIM(a);
        for (int d = 0; d < t->ndim; d++) t->shape[d] = (int64_t)PyArray_DIM(a, d);
        t->itemsize = (size_t)PyArray_ITEMSIZE(a);
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s must be a ctrainstate._C.Buffer or a numpy array, got %.100s",
                 what, Py_TYPE(obj)->tp_name);
    return -1;
}

/* Parse global shape and start (before the target: reading them may run Python code);
 * returns their rank, or -1 with an exception set. */
static int get_block(PyObject *gshape_obj, PyObject *start_obj, int64_t *gshape, int64_t *start) {
    int n1 = ct_py_int64_seq(gshape_obj, gshape, CT_RANDOM_MAX_NDIM, "global_shape");
    if (n1 < 0) return -1;
    int n2 = ct_py_int64_seq(start_obj, start, CT_RANDOM_MAX_NDIM, "start");
    if (n2 < 0) return -1;
    if (n1 != n2) {
        PyErr_Format(PyExc_ValueError, "global_shape has rank %d and start rank %d", n1, n2);
        return -1;
    }
    return n1;
}

/* The block's rank must be the target's. */
static int same_rank(const out_target *t, int rank) {
    if (rank != t->ndim) {
        PyErr_Format(PyExc_ValueError,
                     "global_shape and start have rank %d, but the output block has rank %d",
                     rank, t->ndim);
        return -1;
    }
    return 0;
}

/* --- keys ------------------------------------------------------------------ */

PyDoc_STRVAR(key_split_doc,
             "key_split($module, k0, k1, num, /)\n--\n\n"
             "jax.random.split of the raw key (k0, k1): a uint32 array of shape (num, 2).");

static PyObject *py_key_split(PyObject *self, PyObject *args) {
    (void)self;
    uint32_t k0, k1;
    long long num;
    if (!PyArg_ParseTuple(args, "O&O&L:key_split", ct_py_conv_u32, &k0, ct_py_conv_u32, &k1, &num))
        return NULL;
    if (num < 0) {
        PyErr_Format(PyExc_ValueError, "split: num must be >= 0, got %lld", num);
        return NULL;
    }
    npy_intp dims[2] = { (npy_intp)num, 2 };
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_UINT32);
    if (out == NULL) return NULL;
    uint32_t key[2] = { k0, k1 };
    uint32_t *data = PyArray_DATA((PyArrayObject *)out);
    Py_BEGIN_ALLOW_THREADS
    ct_key_split(key, (uint64_t)num, data);
    Py_END_ALLOW_THREADS
    return out;
}

PyDoc_STRVAR(key_fold_in_doc,
             "key_fold_in($module, k0, k1, data, /)\n--\n\n"
             "jax.random.fold_in of the raw key (k0, k1) with a 32-bit integer: (k0', k1').");

static PyObject *py_key_fold_in(PyObject *self, PyObject *args) {
    (void)self;
    uint32_t k0, k1, data;
    if (!PyArg_ParseTuple(args, "O&O&O&:key_fold_in", ct_py_conv_u32, &k0, ct_py_conv_u32, &k1,
                          ct_py_conv_u32, &data))
        return NULL;
    uint32_t key[2] = { k0, k1 }, out[2];
    ct_key_fold_in(key, data, out);
    return Py_BuildValue("(II)", (unsigned int)out[0], (unsigned int)out[1]);
}

/* --- fills ----------------------------------------------------------------- */

PyDoc_STRVAR(random_bits_doc,
             "random_bits($module, out, k0, k1, global_shape, start, bit_width, /)\n--\n\n"
             "Write into `out` (Buffer or numpy array, the block) the random bits JAX gives the\n"
             "global elements [start, start + out.shape) of an array of global_shape.");

static PyObject *py_random_bits(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *out_obj, *gshape_obj, *start_obj;
    uint32_t k0, k1;
    int bit_width;
    if (!PyArg_ParseTuple(args, "OO&O&OOi:random_bits", &out_obj, ct_py_conv_u32, &k0,
                          ct_py_conv_u32, &k1, &gshape_obj, &start_obj, &bit_width))
        return NULL;
    out_target t;
    int64_t gshape[CT_RANDOM_MAX_NDIM], start[CT_RANDOM_MAX_NDIM];
    const int rank = get_block(gshape_obj, start_obj, gshape, start);
    if (rank < 0 || get_target(out_obj, &t, "out", 0) < 0) return NULL;
    if (same_rank(&t, rank) < 0) goto fail;
    if (t.itemsize * 8 != (size_t)bit_width) {
        PyErr_Format(PyExc_TypeError, "random_bits: %d-bit values into %zu-byte elements",
                     bit_width, t.itemsize);
        goto fail;
    }
    uint32_t key[2] = { k0, k1 };
    ct_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ct_random_bits_block(key, t.ndim, gshape, start, t.shape, bit_width, t.data);
    Py_END_ALLOW_THREADS
    put_target(&t);
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
fail:
    put_target(&t);
    return NULL;
}

/* A checked sampler from random_fill's / random_keyed's arguments, whose output
 * elements must be `itemsize` bytes. */
static int make_sampler(ct_sampler *s, int dist, int dtype, double minval, double maxval,
                        double lower, double upper, double p, PyObject *scale_obj,
                        size_t itemsize, const char *what) {
    memset(s, 0, sizeof *s);
    s->dist = (ct_dist)dist;
    s->dtype = (ct_dtype)dtype;
    s->minval = minval;
    s->maxval = maxval;
    s->lower = lower;
    s->upper = upper;
    s->p = p;
    if (scale_obj != Py_None) {
        s->has_scale = 1;
        s->scale = PyFloat_AsDouble(scale_obj);
        if (s->scale == -1.0 && PyErr_Occurred()) return -1;
    }
    ct_status st = ct_sampler_check(s);
    if (st != CT_OK) {
        ct_py_raise(st);
        return -1;
    }
    size_t want = dist == CT_DIST_BERNOULLI ? 1 : ct_dtype_size(s->dtype);
    if (itemsize != want) {
        PyErr_Format(PyExc_TypeError, "%s: output elements are %zu bytes, expected %zu", what,
                     itemsize, want);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(random_fill_doc,
             "random_fill($module, out, k0, k1, global_shape, start, dist, dtype, minval, maxval,\n"
             "            lower, upper, p, scale, /)\n--\n\n"
             "Write samples of distribution `dist` (0 uniform, 1 normal, 2 truncated normal,\n"
             "3 bernoulli) of core dtype `dtype` into the block `out`, as jax.random does for\n"
             "the global elements [start, start + out.shape). `scale` is None or a float that\n"
             "the samples are then multiplied by in `dtype`. Bernoulli writes bytes 0/1.\n"
             "`out` may be a GPU Buffer when random_on_device(out) is true: the device's\n"
             "kernel fills it, bit-identical to the CPU fill.");

PyDoc_STRVAR(random_on_device_doc,
             "random_on_device($module, buf, /)\n--\n\n"
             "True if random_fill can write the GPU Buffer `buf` directly (its backend has a\n"
             "random kernel); False for CPU buffers and backends without one.");

static PyObject *py_random_on_device(PyObject *self, PyObject *obj) {
    (void)self;
    ct_py_buffer *b = ct_py_buffer_check(obj, "buf");
    if (b == NULL) return NULL;
    return PyBool_FromLong(b->dev->platform != CT_PLATFORM_CPU &&
                           ct_random_device_supported(b->dev));
}

static PyObject *py_random_fill(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *out_obj, *gshape_obj, *start_obj, *scale_obj;
    uint32_t k0, k1;
    int dist, dtype;
    double minval, maxval, lower, upper, p;
    if (!PyArg_ParseTuple(args, "OO&O&OOiidddddO:random_fill", &out_obj, ct_py_conv_u32, &k0,
                          ct_py_conv_u32, &k1, &gshape_obj, &start_obj, &dist, &dtype, &minval,
                          &maxval, &lower, &upper, &p, &scale_obj))
        return NULL;
    out_target t;
    int64_t gshape[CT_RANDOM_MAX_NDIM], start[CT_RANDOM_MAX_NDIM];
    const int rank = get_block(gshape_obj, start_obj, gshape, start);
    if (rank < 0 || get_target(out_obj, &t, "out", 1) < 0) return NULL;
    ct_sampler s;
    if (same_rank(&t, rank) < 0 ||
        make_sampler(&s, dist, dtype, minval, maxval, lower, upper, p, scale_obj, t.itemsize,
                     "random_fill") < 0) {
        put_target(&t);
        return NULL;
    }
    ct_status st;
    uint32_t key[2] = { k0, k1 };
    Py_BEGIN_ALLOW_THREADS
    if (t.dev) /* a GPU buffer: the backend's kernel, queued on the device's stream */
        st = ct_random_fill_block_device(t.dev, key, &s, t.ndim, gshape, start, t.shape, t.data);
    else
        st = ct_random_fill_block(key, &s, t.ndim, gshape, start, t.shape, t.data);
    Py_END_ALLOW_THREADS
    put_target(&t);
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

/* --- arrays of keys ----------------------------------------------------------- */

/* A 1-d C-contiguous uint32 numpy array (a new reference), of n0 elements when
 * n0 >= 0. */
static PyArrayObject *key_words(PyObject *obj, const char *what, npy_intp n0) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_UINT32 ||
        PyArray_NDIM((PyArrayObject *)obj) != 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-d uint32 numpy array", what);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_UINT32, NPY_ARRAY_IN_ARRAY);
    if (a == NULL) return NULL;
    if (n0 >= 0 && PyArray_DIM(a, 0) != n0) {
        PyErr_Format(PyExc_ValueError, "%s has %zd words, the first key array %zd", what,
                     (Py_ssize_t)PyArray_DIM(a, 0), (Py_ssize_t)n0);
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* The two word arrays k0, k1 of n keys; 0, or -1 with an exception set. */
static int key_arrays(PyObject *o0, PyObject *o1, PyArrayObject **a0, PyArrayObject **a1) {
    *a0 = key_words(o0, "k0", -1);
    if (*a0 == NULL) return -1;
    *a1 = key_words(o1, "k1", PyArray_DIM(*a0, 0));
    if (*a1 == NULL) {
        Py_CLEAR(*a0);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(keys_split_doc,
             "keys_split($module, k0, k1, num, /)\n--\n\n"
             "jax.random.split(key_i, num) of n raw keys at once, key i being (k0[i], k1[i])\n"
             "(1-d uint32 arrays of n words): a uint32 array s of shape (num, 2, n) with\n"
             "split(key_i, num)[j] == (s[j, 0, i], s[j, 1, i]).");

static PyObject *py_keys_split(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o0, *o1;
    long long num;
    if (!PyArg_ParseTuple(args, "OOL:keys_split", &o0, &o1, &num)) return NULL;
    if (num < 0) {
        PyErr_Format(PyExc_ValueError, "split: num must be >= 0, got %lld", num);
        return NULL;
    }
    PyArrayObject *a0, *a1;
    if (key_arrays(o0, o1, &a0, &a1) < 0) return NULL;
    npy_intp n = PyArray_DIM(a0, 0);
    npy_intp dims[3] = { (npy_intp)num, 2, n };
    PyObject *out = PyArray_SimpleNew(3, dims, NPY_UINT32);
    if (out != NULL) {
        const uint32_t *k0 = PyArray_DATA(a0), *k1 = PyArray_DATA(a1);
        uint32_t *o = PyArray_DATA((PyArrayObject *)out);
        Py_BEGIN_ALLOW_THREADS
        ct_keys_split((size_t)n, k0, k1, (uint64_t)num, o);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(a0);
    Py_DECREF(a1);
    return out;
}

PyDoc_STRVAR(random_keyed_doc,
             "random_keyed($module, out, k0, k1, dist, dtype, minval, maxval, lower, upper, p,\n"
             "             scale, /)\n--\n\n"
             "out[i] = the sample of shape () that raw key (k0[i], k1[i]) gives (1-d uint32\n"
             "arrays of n words): jax's `sampler(key_i, (), dtype, ...)` of every key at once.\n"
             "`out`: a C-contiguous numpy array of n elements of core dtype `dtype` (bytes 0/1\n"
             "for bernoulli); the other arguments as random_fill's.");

static PyObject *py_random_keyed(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *out_obj, *o0, *o1, *scale_obj;
    int dist, dtype;
    double minval, maxval, lower, upper, p;
    if (!PyArg_ParseTuple(args, "OOOiidddddO:random_keyed", &out_obj, &o0, &o1, &dist, &dtype,
                          &minval, &maxval, &lower, &upper, &p, &scale_obj))
        return NULL;
    if (!PyArray_Check(out_obj)) {
        PyErr_Format(PyExc_TypeError, "random_keyed: out must be a numpy array, got %.100s",
                     Py_TYPE(out_obj)->tp_name);
        return NULL;
    }
    out_target t;
    if (get_target(out_obj, &t, "out", 0) < 0) return NULL; /* a numpy array: nothing pinned */
    ct_sampler s;
    if (make_sampler(&s, dist, dtype, minval, maxval, lower, upper, p, scale_obj, t.itemsize,
                     "random_keyed") < 0)
        return NULL;
    PyArrayObject *a0, *a1;
    if (key_arrays(o0, o1, &a0, &a1) < 0) return NULL;
    npy_intp n = PyArray_DIM(a0, 0);
    ct_status st = CT_OK;
    if (PyArray_SIZE((PyArrayObject *)out_obj) != n) {
        PyErr_Format(PyExc_ValueError, "random_keyed: out has %zd elements for %zd keys",
                     (Py_ssize_t)PyArray_SIZE((PyArrayObject *)out_obj), (Py_ssize_t)n);
    } else {
        const uint32_t *k0 = PyArray_DATA(a0), *k1 = PyArray_DATA(a1);
        Py_BEGIN_ALLOW_THREADS
        st = ct_random_keyed(&s, (size_t)n, k0, k1, t.data);
        Py_END_ALLOW_THREADS
        if (st != CT_OK) ct_py_raise(st);
    }
    Py_DECREF(a0);
    Py_DECREF(a1);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* A float32 numpy array the xla_* bindings may read and write in place, or NULL with
 * TypeError naming `what`. */
static PyArrayObject *f32_carray(PyObject *obj, const char *fn, const char *what) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_FLOAT32 ||
        !PyArray_ISCARRAY((PyArrayObject *)obj) || !PyArray_ISNOTSWAPPED((PyArrayObject *)obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a C-contiguous, aligned, writeable, native-order float32 "
                     "numpy array, got %.100s", fn, what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (PyArrayObject *)obj;
}

PyDoc_STRVAR(xla_math_doc,
             "xla_math($module, fn, x, /)\n--\n\n"
             "Replace every element of the C-contiguous float32 numpy array `x` by XLA's\n"
             "float32 log (fn 0) or log1p (fn 1) of it: the bits jnp.log / jnp.log1p give on\n"
             "CPU (numpy's log differs in the last place). For samplers finished on the host.");

static PyObject *py_xla_math(PyObject *self, PyObject *args) {
    (void)self;
    int fn;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "iO:xla_math", &fn, &obj)) return NULL;
    PyArrayObject *a = f32_carray(obj, "xla_math", "x");
    if (a == NULL) return NULL;
    float *data = (float *)PyArray_DATA(a);
    size_t n = (size_t)PyArray_SIZE(a);
    ct_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ct_xla_math_n(fn, data, n);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(xla_pow_doc,
             "xla_pow($module, x, y, /)\n--\n\n"
             "Replace every element of the float32 array `x` by XLA's float32 pow(x, y) on\n"
             "CPU (the C library's powf run with denormals flushed to zero): the bits\n"
             "jax.lax.pow gives, whatever numpy's own float32 power does on this CPU. `y`:\n"
             "a float32 array of as many elements. Both C-contiguous, native order.");

static PyObject *py_xla_pow(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    if (!PyArg_ParseTuple(args, "OO:xla_pow", &xo, &yo)) return NULL;
    PyArrayObject *x = f32_carray(xo, "xla_pow", "x"), *y;
    if (x == NULL || (y = f32_carray(yo, "xla_pow", "y")) == NULL) return NULL;
    if (PyArray_SIZE(x) != PyArray_SIZE(y)) {
        PyErr_Format(PyExc_ValueError, "xla_pow: x has %zd elements and y %zd",
                     (Py_ssize_t)PyArray_SIZE(x), (Py_ssize_t)PyArray_SIZE(y));
        return NULL;
    }
    float *xd = (float *)PyArray_DATA(x);
    const float *yd = (const float *)PyArray_DATA(y);
    size_t n = (size_t)PyArray_SIZE(x);
    ct_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ct_xla_pow_n(xd, yd, n);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(random_cpu_path_doc,
             "random_cpu_path($module, /)\n--\n\n"
             "The CPU fill path float32 normal / truncated-normal samples take: 'avx512'\n"
             "(CPUs with AVX-512, unless CTRAINSTATE_NO_AVX512 is set), 'avx2' (CPUs with\n"
             "AVX2 and FMA, unless CTRAINSTATE_NO_AVX2 is set) or 'portable'. Every path\n"
             "gives the same bits; the choice is made once, at the first fill.");

static PyObject *py_random_cpu_path(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(ct_random_cpu_path());
}

static PyMethodDef random_methods[] = {
    { "random_cpu_path", py_random_cpu_path, METH_NOARGS, random_cpu_path_doc },
    { "key_split", py_key_split, METH_VARARGS, key_split_doc },
    { "key_fold_in", py_key_fold_in, METH_VARARGS, key_fold_in_doc },
    { "random_bits", py_random_bits, METH_VARARGS, random_bits_doc },
    { "random_fill", py_random_fill, METH_VARARGS, random_fill_doc },
    { "keys_split", py_keys_split, METH_VARARGS, keys_split_doc },
    { "random_keyed", py_random_keyed, METH_VARARGS, random_keyed_doc },
    { "random_on_device", py_random_on_device, METH_O, random_on_device_doc },
    { "xla_math", py_xla_math, METH_VARARGS, xla_math_doc },
    { "xla_pow", py_xla_pow, METH_VARARGS, xla_pow_doc },
    { NULL, NULL, 0, NULL },
};

int ct_py_init_random(PyObject *m) {
    return PyModule_AddFunctions(m, random_methods);
}
