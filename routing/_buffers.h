/*
 * routing/_buffers.h: reading a buffer of unsigned ints, shared by routing/_blocktable.c
 * (block keys: 8-byte) and routing/_chain.c (token ids: 4-byte).
 */
#ifndef PREFIX_SERVE_BUFFERS_H
#define PREFIX_SERVE_BUFFERS_H

#include <Python.h>
#include <string.h>

/* Get `obj`'s buffer as `itemsize`-byte unsigned ints in native order: raw bytes (format
 * NULL, "B", "b", "c": bytes, bytearray) or a C-contiguous buffer of unsigned ints of
 * exactly that width ("Q", "=Q", "@Q", "<Q" on little-endian hosts, "L" or "I" where that
 * is the width).  Anything else (signed or float items, another width, big-endian, strides)
 * raises TypeError / BufferError; a length that is not whole items raises ValueError.
 * 0 with the view filled (release it with PyBuffer_Release), or -1. */
static int
uint_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_ND | PyBUF_FORMAT) < 0) /* C-contiguous, format named */
        return -1;
    const char *f = view->format;
    int ok = f == NULL || strcmp(f, "B") == 0 || strcmp(f, "b") == 0 || strcmp(f, "c") == 0;
    if (!ok) {
        if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN))
            f++;
        ok = view->itemsize == itemsize && strlen(f) == 1 && strchr("BHILQ", *f) != NULL;
    }
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes or a buffer of %zd-byte unsigned ints, not format '%s'",
                     what, itemsize, view->format);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold whole %zd-byte items, got %zd bytes", what, itemsize,
                     view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#endif
