/*
 * py_device.c — bindings for the device registry and memory statistics.
 */
#include "ct_py.h"

#include <string.h>

#include "../core/ct_par.h"

static int parse_platform(const char *s, ct_platform *out) {
    if (strcmp(s, "cpu") == 0) *out = CT_PLATFORM_CPU;
    else if (strcmp(s, "gpu") == 0 || strcmp(s, "cuda") == 0) *out = CT_PLATFORM_GPU;
    else {
        PyErr_Format(PyExc_ValueError, "unknown backend '%s'; expected 'cpu' or 'gpu'", s);
        return -1;
    }
    return 0;
}

static PyObject *py_device_ids(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    ct_platform p;
    if (parse_platform(name, &p) < 0) return NULL;
    ct_status st = ct_devices_init();
    if (st != CT_OK) return ct_py_raise(st);
    int n = ct_device_count(p);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        ct_device *d = ct_device_get(p, i);
        PyObject *v = PyLong_FromLong(ct_device_global_id(d));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static ct_device *device_arg(PyObject *arg) {
    int id;
    if (!ct_py_conv_int(arg, &id)) return NULL;
    ct_device *d = ct_device_by_id(id);
    if (d == NULL) ct_py_raise(CT_EINVAL);
    return d;
}

static PyObject *py_memory_stats(PyObject *self, PyObject *arg) {
    (void)self;
    ct_device *d = device_arg(arg);
    if (d == NULL) return NULL;
    size_t limit = d->bytes_limit;
    if (limit == 0) limit = (size_t)PY_SSIZE_T_MAX; /* no limit set: report "unbounded" */
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n}", "bytes_in_use",
                         (Py_ssize_t)atomic_load(&d->bytes_in_use), "peak_bytes_in_use",
                         (Py_ssize_t)atomic_load(&d->peak_bytes_in_use), "bytes_limit",
                         (Py_ssize_t)limit, "num_allocs", (Py_ssize_t)atomic_load(&d->num_allocs),
                         "largest_alloc_size", (Py_ssize_t)atomic_load(&d->largest_alloc_size));
}

static PyObject *py_reset_peaks(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    ct_devices_reset_peaks();
    Py_RETURN_NONE;
}

static PyObject *py_synchronize(PyObject *self, PyObject *arg) {
    (void)self;
    ct_device *d = device_arg(arg);
    if (d == NULL) return NULL;
    ct_status st;
    Py_BEGIN_ALLOW_THREADS
    st = d->backend->synchronize(d);
    Py_END_ALLOW_THREADS
    if (st != CT_OK) return ct_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_gpu_status(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(ct_gpu_status());
}

static PyObject *py_device_ordinal(PyObject *self, PyObject *arg) {
    (void)self;
    ct_device *d = device_arg(arg);
    if (d == NULL) return NULL;
    return PyLong_FromLong(d->ordinal);
}

static PyObject *py_forked_single_threaded(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyBool_FromLong(ct_par_forked_single());
}

static PyObject *py_devices_set_id_offset(PyObject *self, PyObject *args) {
    (void)self;
    int offset, total;
    if (!PyArg_ParseTuple(args, "ii:devices_set_id_offset", &offset, &total)) return NULL;
    if (ct_devices_set_id_offset(offset, total) != CT_OK) return ct_py_raise(CT_EINVAL);
    Py_RETURN_NONE;
}

static PyObject *py_devices_set_cuda_backend(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "devices_set_cuda_backend: a path (str), not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t len;
    const char *path = PyUnicode_AsUTF8AndSize(arg, &len);
    if (path == NULL) return NULL;
    if (strlen(path) != (size_t)len) {
        PyErr_SetString(PyExc_ValueError, "devices_set_cuda_backend: embedded NUL in the path");
        return NULL;
    }
    if (ct_devices_set_cuda_backend(path) != CT_OK) return ct_py_raise(CT_EINVAL);
    Py_RETURN_NONE;
}

static PyMethodDef device_methods[] = {
    {"devices_set_cuda_backend", py_devices_set_cuda_backend, METH_O,
     "devices_set_cuda_backend($module, path, /)\n--\n\nName `path` as the package's own CUDA "
     "backend, before devices are first used: when CTRAINSTATE_CUDA_BACKEND names it, the "
     "device probe skips loading it where the NVIDIA driver (libcuda.so.1) is missing. "
     "ValueError once devices exist."},
    {"devices_set_id_offset", py_devices_set_id_offset, METH_VARARGS,
     "devices_set_id_offset($module, offset, total, /)\n--\n\nMake this process's device ids "
     "global, once: local index + offset, in a job of `total` devices "
     "(ctrainstate.distributed.initialize). ValueError when already set otherwise."},
    {"forked_single_threaded", py_forked_single_threaded, METH_NOARGS,
     "forked_single_threaded($module, /)\n--\n\nWhether this process is a fork()ed child of a "
     "process that had started the OpenMP thread pool: CPU kernels run on one thread here "
     "(the pool does not survive fork)."},
    {"device_ordinal", py_device_ordinal, METH_O,
     "device_ordinal($module, device_id, /)\n--\n\nThe physical GPU (or 0) a device lives on."},
    {"gpu_status", py_gpu_status, METH_NOARGS,
     "gpu_status($module, /)\n--\n\nOne line saying whether GPUs were found, or why not."},
    {"device_ids", py_device_ids, METH_O,
     "device_ids($module, platform, /)\n--\n\nGlobal ids of the devices of a platform ('cpu' or "
     "'gpu'), creating the registry on first use."},
    {"memory_stats", py_memory_stats, METH_O,
     "memory_stats($module, device_id, /)\n--\n\nbytes_in_use, peak_bytes_in_use, bytes_limit, "
     "num_allocs and largest_alloc_size of a device."},
    {"reset_peak_memory_stats", py_reset_peaks, METH_NOARGS,
     "reset_peak_memory_stats($module, /)\n--\n\nSet every device's peak to its bytes in use."},
    {"synchronize", py_synchronize, METH_O,
     "synchronize($module, device_id, /)\n--\n\nWait for all work queued on a device."},
    {NULL, NULL, 0, NULL},
};

int ct_py_init_devices(PyObject *m) { return PyModule_AddFunctions(m, device_methods); }
