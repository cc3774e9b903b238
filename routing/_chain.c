/*
 * routing._chain: the loop of routing.block_keys.chain_keys, in C.
 *
 * The keys are those of the pure definition in routing/block_keys.py:
 * key_i = hasher(block_bytes_i + tail, key_{i-1}), the hasher being
 * xxhash.xxh3_64_intdigest, called through its Python API (the hashing
 * stays the xxhash library's).  What moves to C is the per-block
 * interpreter work around the call: slicing the block out of the token
 * buffer and appending the tail (copied into one reused bytearray instead
 * of a new bytes object and tuple per block) and the list building.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyDoc_STRVAR(chain_keys_doc,
             "chain_keys(hasher, tokens, block_size, seed, tail, /)\n--\n\n"
             "``[k_0, ..., k_{n-1}]`` with ``k_i = hasher(block_i + tail, k_{i-1})`` and\n"
             "``k_{-1} = seed``; ``block_i`` is bytes ``[4 * block_size * i, 4 * block_size * (i + 1))``\n"
             "of ``tokens`` (any buffer: uint32-LE token ids), ``tail`` a bytes-like object\n"
             "(``b\"\"`` for none).\n\n"
             "Raises ValueError when ``block_size`` is not positive or the buffer is not a\n"
             "whole number of blocks; whatever ``hasher`` raises.");

static PyObject *
chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "chain_keys() takes 5 positional arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *hasher = args[0];
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0 || block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", block_size);
        return NULL;
    }
    Py_buffer view, tail;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[4], &tail, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t piece = 4 * block_size;
    PyObject *result = NULL;
    PyObject *scratch = NULL;
    if (tail.len > PY_SSIZE_T_MAX - piece) {
        PyErr_SetString(PyExc_OverflowError, "tail too long");
        goto done;
    }
    if (view.len % piece != 0) {
        PyErr_Format(PyExc_ValueError, "tokens hold %zd bytes, not a whole number of %zd-byte blocks", view.len,
                     piece);
        goto done;
    }
    Py_ssize_t n = view.len / piece;
    result = PyList_New(n);
    scratch = PyByteArray_FromStringAndSize(NULL, piece + tail.len);
    if (result == NULL || scratch == NULL) {
        Py_CLEAR(result);
        goto done;
    }
    char *dst = PyByteArray_AS_STRING(scratch);
    if (tail.len)
        memcpy(dst + piece, tail.buf, (size_t)tail.len);
    const char *src = (const char *)view.buf;
    PyObject *key = args[3]; /* borrowed: the seed, then the list's previous item */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_REFCNT(scratch) != 1 || PyByteArray_GET_SIZE(scratch) != piece + tail.len) {
            /* the hasher kept or resized the buffer: hash from a fresh one */
            Py_SETREF(scratch, PyByteArray_FromStringAndSize(NULL, piece + tail.len));
            if (scratch == NULL) {
                Py_CLEAR(result);
                goto done;
            }
            dst = PyByteArray_AS_STRING(scratch);
            if (tail.len)
                memcpy(dst + piece, tail.buf, (size_t)tail.len);
        }
        memcpy(dst, src + i * piece, (size_t)piece);
        PyObject *call[2] = {scratch, key};
        PyObject *next = PyObject_Vectorcall(hasher, call, 2, NULL);
        if (next == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, next); /* steals */
        key = next;
    }
done:
    Py_XDECREF(scratch);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef chain_methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL, chain_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "routing._chain",
    .m_doc = "The block-key chaining loop (see routing.block_keys.chain_keys).",
    .m_size = -1,
    .m_methods = chain_methods,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    return PyModule_Create(&chain_module);
}
