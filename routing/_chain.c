/*
 * routing._chain: the block-key chaining loop of routing.block_keys, in C.
 *
 * key_i = XXH3_64bits_withSeed(block_bytes_i + tail, seed = key_{i-1}), with
 * xxHash's own C library (header-only: XXH_INLINE_ALL; Debian's libxxhash-dev,
 * https://github.com/Cyan4973/xxHash).  XXH3's output is frozen since xxHash
 * 0.8.0, so these are the keys that Python's xxhash.xxh3_64_intdigest gives
 * (tests/test_block_keys.py checks them against it).  No Python object is made
 * per block: the keys go straight into the result's uint64 buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_buffers.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#if XXH_VERSION_NUMBER < 800
#error "xxHash 0.8.0 or newer is needed (XXH3's output is stable from 0.8.0)"
#endif

PyDoc_STRVAR(chain_keys_doc,
             "chain_keys(tokens, block_size, seed, tail, /)\n--\n\n"
             "The chained keys of the blocks of ``tokens``, as ``bytes`` of native-order uint64:\n"
             "``k_i = xxh3_64(block_i + tail, seed=k_{i-1})`` and ``k_{-1} = seed``; ``block_i``\n"
             "is bytes ``[4 * block_size * i, 4 * block_size * (i + 1))`` of ``tokens`` (uint32-LE\n"
             "token ids: bytes or an ``array('I')``), ``tail`` bytes (``b\"\"`` for none).\n\n"
             "Raises ValueError when ``block_size`` is not positive or the buffer is not a\n"
             "whole number of blocks; OverflowError when ``seed`` is not in [0, 2**64).");

static PyObject *
chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "chain_keys() takes 4 positional arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0 || block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "block_size must be in [1, %zd], got %zd", PY_SSIZE_T_MAX / 4, block_size);
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_Format(PyExc_TypeError, "seed must be an int, not %.100s", Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view, tail;
    if (uint_buffer(args[0], &view, 4, "tokens") < 0)
        return NULL;
    if (uint_buffer(args[3], &tail, 1, "tail") < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t piece = 4 * (size_t)block_size;
    PyObject *result = NULL;
    char *scratch = NULL;
    if (view.len % (Py_ssize_t)piece != 0) {
        PyErr_Format(PyExc_ValueError, "tokens hold %zd bytes, not a whole number of %zu-byte blocks", view.len,
                     piece);
        goto done;
    }
    size_t n = (size_t)view.len / piece;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(uint64_t)));
    if (result == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(result);
    const char *src = (const char *)view.buf;
    uint64_t key = (uint64_t)seed;
    if (tail.len == 0) {
        for (size_t i = 0; i < n; i++) {
            key = XXH3_64bits_withSeed(src + i * piece, piece, key);
            memcpy(out + i * sizeof(uint64_t), &key, sizeof(uint64_t));
        }
        goto done;
    }
    /* With a tail: hash block + tail from one buffer (the tail copied once, each block over it). */
    scratch = PyMem_Malloc(piece + (size_t)tail.len);
    if (scratch == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(result);
        goto done;
    }
    memcpy(scratch + piece, tail.buf, (size_t)tail.len);
    for (size_t i = 0; i < n; i++) {
        memcpy(scratch, src + i * piece, piece);
        key = XXH3_64bits_withSeed(scratch, piece + (size_t)tail.len, key);
        memcpy(out + i * sizeof(uint64_t), &key, sizeof(uint64_t));
    }
done:
    PyMem_Free(scratch);
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
    .m_doc = "The block-key chaining loop (see routing.block_keys), on xxHash's C library.",
    .m_size = -1,
    .m_methods = chain_methods,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    return PyModule_Create(&chain_module);
}
