/*
 * py_dlpack.c — DLPack export of Buffers and import of foreign tensors.
 *
 * Export: Buffer.__dlpack__() hands out the buffer's memory without a copy; the
 * capsule keeps the Buffer alive (and undeletable) until the consumer calls the
 * deleter. Import: dlpack_copy_into(buffer, capsule) copies a foreign tensor
 * (CPU, or CUDA on the buffer's GPU) into a Buffer of the same shape and dtype,
 * honouring its strides, through the device backend.
 */
#include "ct_py.h"

#include <string.h>

#include "ct_dlpack.h"

typedef struct {
    DLManagedTensor tensor;
    PyObject *owner;          /* the Buffer */
    int64_t shape[CT_MAX_NDIM];
} export_ctx;

static void export_deleter(DLManagedTensor *self) {
    export_ctx *ctx = (export_ctx *)self->manager_ctx;
    PyGILState_STATE g = PyGILState_Ensure(); /* consumers may call this from any thread */
    ct_py_buffer *b = (ct_py_buffer *)ctx->owner;
    b->exports--;
    Py_DECREF(ctx->owner);
    PyMem_RawFree(ctx);
    PyGILState_Release(g);
}

static void capsule_destructor(PyObject *cap) {
    /* Only an unconsumed capsule still owns its tensor. */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *t = PyCapsule_GetPointer(cap, "dltensor");
        if (t != NULL && t->deleter != NULL) t->deleter(t);
    }
}

static int dl_dtype(ct_dtype dt, DLDataType *out) {
    out->lanes = 1;
    switch (dt) {
    case CT_F32: out->code = kDLFloat; out->bits = 32; return 0;
    case CT_F16: out->code = kDLFloat; out->bits = 16; return 0;
    case CT_BF16: out->code = kDLBfloat; out->bits = 16; return 0;
    case CT_I32: out->code = kDLInt; out->bits = 32; return 0;
    case CT_U32: out->code = kDLUInt; out->bits = 32; return 0;
    case CT_BOOL: out->code = kDLBool; out->bits = 8; return 0;
    case CT_U8: out->code = kDLUInt; out->bits = 8; return 0;
    case CT_I8: out->code = kDLInt; out->bits = 8; return 0;
    case CT_I16: out->code = kDLInt; out->bits = 16; return 0;
    case CT_U16: out->code = kDLUInt; out->bits = 16; return 0;
    default: return -1;
    }
}

static PyObject *buffer_dlpack(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *maxv = Py_None, *dldev = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$OOO:__dlpack__", kwlist, &stream, &maxv,
                                     &dldev, &copy))
        return NULL;
    ct_py_buffer *b = ct_py_buffer_check(self, "__dlpack__");
    if (b == NULL) return NULL;
    if (copy == Py_True) {
        PyErr_SetString(PyExc_BufferError, "__dlpack__(copy=True) is not supported; export shares memory");
        return NULL;
    }
    export_ctx *ctx = PyMem_RawCalloc(1, sizeof *ctx);
    if (ctx == NULL) return PyErr_NoMemory();
    DLTensor *t = &ctx->tensor.dl_tensor;
    t->data = b->data;
    t->device.device_type = b->dev->platform == CT_PLATFORM_CPU ? kDLCPU : kDLCUDA;
    t->device.device_id = b->dev->platform == CT_PLATFORM_CPU ? 0 : b->dev->ordinal;
    t->ndim = b->ndim;
    if (dl_dtype(b->dtype, &t->dtype) < 0) {
        PyMem_RawFree(ctx);
        PyErr_SetString(PyExc_BufferError, "dtype has no DLPack code");
        return NULL;
    }
    memcpy(ctx->shape, b->shape, sizeof(int64_t) * (size_t)b->ndim);
    t->shape = ctx->shape;
    t->strides = NULL;
    t->byte_offset = 0;
    ctx->tensor.manager_ctx = ctx;
    ctx->tensor.deleter = export_deleter;
    ctx->owner = Py_NewRef(self);
    b->exports++;
    /* Work queued on the device's stream must finish before a consumer on another stream
     * reads the memory. */
    if (b->dev->platform != CT_PLATFORM_CPU) {
        ct_status st;
        Py_BEGIN_ALLOW_THREADS
        st = b->dev->backend->synchronize(b->dev);
        Py_END_ALLOW_THREADS
        if (st != CT_OK) {
            export_deleter(&ctx->tensor);
            return ct_py_raise(st);
        }
    }
    PyObject *cap = PyCapsule_New(&ctx->tensor, "dltensor", capsule_destructor);
    if (cap == NULL) export_deleter(&ctx->tensor);
    return cap;
}

static PyObject *buffer_dlpack_device(PyObject *self, PyObject *noargs) {
    (void)noargs;
    ct_py_buffer *b = ct_py_buffer_check(self, "__dlpack_device__");
    if (b == NULL) return NULL;
    if (b->dev->platform == CT_PLATFORM_CPU) return Py_BuildValue("(ii)", kDLCPU, 0);
    return Py_BuildValue("(ii)", kDLCUDA, b->dev->ordinal);
}

/* dlpack_copy_into(buffer, capsule): copy a foreign DLPack tensor into `buffer`. */
static PyObject *py_dlpack_copy_into(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bobj, *cap;
    if (!PyArg_ParseTuple(args, "OO:dlpack_copy_into", &bobj, &cap)) return NULL;
    ct_py_buffer *b = ct_py_buffer_check(bobj, "destination buffer");
    if (b == NULL) return NULL;
    if (!PyCapsule_IsValid(cap, "dltensor")) {
        PyErr_SetString(PyExc_TypeError, "expected an unconsumed DLPack capsule ('dltensor')");
        return NULL;
    }
    DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
    DLTensor *t = &mt->dl_tensor;
    DLDataType want;
    if (dl_dtype(b->dtype, &want) < 0 || t->dtype.code != want.code || t->dtype.bits != want.bits ||
        t->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "DLPack dtype (code %d, %d bits) does not match %s",
                     t->dtype.code, t->dtype.bits, ct_dtype_name(b->dtype));
        return NULL;
    }
    if (t->ndim != b->ndim) {
        PyErr_Format(PyExc_ValueError, "DLPack tensor of rank %d for a buffer of rank %d", t->ndim, b->ndim);
        return NULL;
    }
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] != b->shape[d]) {
            PyErr_SetString(PyExc_ValueError, "DLPack tensor shape differs from the buffer's");
            return NULL;
        }
    int src_on_gpu = t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged;
    int src_host = t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost;
    if (!src_on_gpu && !src_host) {
        PyErr_Format(PyExc_ValueError, "DLPack device type %d is not supported", t->device.device_type);
        return NULL;
    }
    if (src_on_gpu && (b->dev->platform != CT_PLATFORM_GPU || b->dev->ordinal != t->device.device_id)) {
        PyErr_Format(PyExc_ValueError,
                     "a tensor on GPU %d can be imported only onto a device of that GPU",
                     t->device.device_id);
        return NULL;
    }
    size_t isz = ct_dtype_size(b->dtype);
    int64_t src_strides[CT_MAX_NDIM], dst_strides[CT_MAX_NDIM], s = (int64_t)isz;
    for (int d = b->ndim - 1; d >= 0; d--) {
        dst_strides[d] = s;
        src_strides[d] = t->strides ? t->strides[d] * (int64_t)isz : s;
        s *= b->shape[d];
    }
    const char *src = (const char *)t->data + t->byte_offset;
    ct_device *src_dev = src_on_gpu ? b->dev : NULL; /* same GPU: device-to-device */
    const ct_backend *be = b->dev->backend;
    ct_status st;
    ct_py_pin(b);
    Py_BEGIN_ALLOW_THREADS
    st = be->copy_block(b->dev, src_dev, b->ndim, b->shape, isz, b->data, dst_strides, src,
                        src_strides);
    Py_END_ALLOW_THREADS
    ct_py_unpin(b);
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

static PyMethodDef dlpack_buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, /, stream=None, *, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Export the buffer as a DLPack capsule (no copy)."},
    {"__dlpack_device__", buffer_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(device_type, device_id) in DLPack codes."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef dlpack_methods[] = {
    {"dlpack_copy_into", py_dlpack_copy_into, METH_VARARGS,
     "dlpack_copy_into($module, buffer, capsule, /)\n--\n\nCopy a DLPack tensor into a Buffer "
     "of the same shape and dtype."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_dlpack(PyObject *m) {
    /* Add the protocol methods to Buffer (the type is ready, not yet used). */
    for (PyMethodDef *d = dlpack_buffer_methods; d->ml_name != NULL; d++) {
        PyObject *descr = PyDescr_NewMethod(&ct_py_BufferType, d);
        if (descr == NULL) return -1;
        int rc = PyDict_SetItemString(ct_py_BufferType.tp_dict, d->ml_name, descr);
        Py_DECREF(descr);
        if (rc < 0) return -1;
    }
    PyType_Modified(&ct_py_BufferType);
    return PyModule_AddFunctions(m, dlpack_methods);
}
