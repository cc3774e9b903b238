/*
 * routing._blocktable: the block index's key -> holders map, in C.
 *
 * BlockTable maps a 64-bit block key (routing.block_keys) to a Python int
 * (the bit mask of the replicas holding the block) and keeps one
 * "referenced" flag per key for the index's CLOCK eviction.  It is an
 * open-addressing hash table with linear probing and backward-shift
 * deletion: each entry is one 16-byte slot {key, mask pointer | flag}, so a
 * probe touches one cache line instead of a dict's index, entry and key
 * object (about three cache misses a lookup in a dict of 10^5 int keys).
 * walk() runs a prompt's whole lookup in C and prefetches the slots of the
 * keys ahead of the one being compared.
 *
 * Slots are placed by fmix64(key ^ seed) (MurmurHash3's 64-bit finaliser);
 * the caller passes a random seed so that prompts cannot be crafted to pile
 * up in one probe run.  The load factor stays at or below 1/2.
 *
 * Values must be exact ints (masks): ints hold no references, so the table
 * needs no cyclic-GC support.  Not thread-safe beyond the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    uintptr_t value; /* PyObject * | REF_BIT; 0 = empty slot */
} Slot;

#define REF_BIT ((uintptr_t)1)
#define SLOT_MASK(s) ((PyObject *)((s)->value & ~REF_BIT))
#define MIN_CAPACITY 64
#define PREFETCH_AHEAD 8

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 1)
#else
#define PREFETCH(p) ((void)(p))
#endif

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t capacity_mask; /* capacity - 1, capacity a power of two */
    Py_ssize_t used;
    uint64_t seed;
} BlockTable;

static inline uint64_t
home_of(uint64_t key, uint64_t seed)
{
    uint64_t k = key ^ seed;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

/* Index of key's slot, or of the empty slot where it would go. */
static inline size_t
find(const BlockTable *t, uint64_t key)
{
    size_t m = t->capacity_mask;
    size_t i = (size_t)home_of(key, t->seed) & m;
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->value == 0 || s->key == key)
            return i;
        i = (i + 1) & m;
    }
}

static int
resize(BlockTable *t, size_t capacity)
{
    Slot *fresh = PyMem_Calloc(capacity, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = t->slots;
    size_t old_capacity = old ? t->capacity_mask + 1 : 0;
    t->slots = fresh;
    t->capacity_mask = capacity - 1;
    for (size_t j = 0; j < old_capacity; j++) {
        if (old[j].value)
            t->slots[find(t, old[j].key)] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

/* Remove the entry in occupied slot i (its reference already handled). */
static void
erase(BlockTable *t, size_t i)
{
    size_t m = t->capacity_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & m;
        Slot *s = &t->slots[j];
        if (s->value == 0)
            break;
        size_t h = (size_t)home_of(s->key, t->seed) & m;
        /* The entry at j may fill the hole at i unless its home lies in (i, j]. */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            t->slots[i] = *s;
            i = j;
        }
    }
    t->slots[i].key = 0;
    t->slots[i].value = 0;
    t->used--;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most)
{
    if (nargs < least || nargs > most) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd positional arguments (%zd given)", name, least, most,
                     nargs);
        return 0;
    }
    return 1;
}

static int
key_of(PyObject *obj, uint64_t *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block key must be an int, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "block key must be in [0, 2**64)");
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* ------------------------------------------------------------------ type */

static PyObject *
BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|K:BlockTable", kwlist, &seed))
        return NULL;
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->seed = (uint64_t)seed;
    t->used = 0;
    t->slots = NULL;
    if (resize(t, MIN_CAPACITY) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
release_all(BlockTable *t)
{
    if (t->slots == NULL)
        return;
    size_t capacity = t->capacity_mask + 1;
    for (size_t j = 0; j < capacity; j++) {
        if (t->slots[j].value) {
            PyObject *v = SLOT_MASK(&t->slots[j]);
            t->slots[j].value = 0;
            Py_DECREF(v);
        }
    }
    t->used = 0;
}

static void
BlockTable_dealloc(BlockTable *t)
{
    release_all(t);
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
BlockTable_len(BlockTable *t)
{
    return t->used;
}

static PyObject *
lookup(BlockTable *t, PyObject *key_obj)
{
    uint64_t key;
    if (key_of(key_obj, &key) < 0)
        return NULL;
    Slot *s = &t->slots[find(t, key)];
    return s->value ? SLOT_MASK(s) : NULL; /* borrowed */
}

static PyObject *
BlockTable_subscript(BlockTable *t, PyObject *key_obj)
{
    PyObject *v = lookup(t, key_obj);
    if (v == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key_obj);
        return NULL;
    }
    return Py_NewRef(v);
}

static int
BlockTable_ass_subscript(BlockTable *t, PyObject *key_obj, PyObject *value)
{
    uint64_t key;
    if (key_of(key_obj, &key) < 0)
        return -1;
    size_t i = find(t, key);
    Slot *s = &t->slots[i];
    if (value == NULL) {
        if (!s->value) {
            PyErr_SetObject(PyExc_KeyError, key_obj);
            return -1;
        }
        PyObject *old = SLOT_MASK(s);
        erase(t, i);
        Py_DECREF(old);
        return 0;
    }
    if (!PyLong_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "BlockTable values must be int masks, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    if (s->value) { /* replace the mask, keep the referenced flag */
        PyObject *old = SLOT_MASK(s);
        s->value = (uintptr_t)Py_NewRef(value) | (s->value & REF_BIT);
        Py_DECREF(old);
        return 0;
    }
    if ((size_t)(t->used + 1) * 2 > t->capacity_mask + 1) {
        if (resize(t, (t->capacity_mask + 1) * 2) < 0)
            return -1;
        s = &t->slots[find(t, key)];
    }
    s->key = key;
    s->value = (uintptr_t)Py_NewRef(value);
    t->used++;
    return 0;
}

static int
BlockTable_contains(BlockTable *t, PyObject *key_obj)
{
    PyObject *v = lookup(t, key_obj);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return 1;
}

PyDoc_STRVAR(get_doc, "get(key, default=None, /)\n--\n\nThe mask of ``key``, or ``default`` when absent.");

static PyObject *
BlockTable_get(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("get", nargs, 1, 2))
        return NULL;
    PyObject *v = lookup(t, args[0]);
    if (v == NULL) {
        if (PyErr_Occurred())
            return NULL;
        v = nargs > 1 ? args[1] : Py_None;
    }
    return Py_NewRef(v);
}

PyDoc_STRVAR(pop_doc, "pop(key, default, /)\n--\n\nRemove ``key`` and return its mask, or ``default`` when absent.");

static PyObject *
BlockTable_pop(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("pop", nargs, 2, 2))
        return NULL;
    uint64_t key;
    if (key_of(args[0], &key) < 0)
        return NULL;
    size_t i = find(t, key);
    Slot *s = &t->slots[i];
    if (!s->value)
        return Py_NewRef(args[1]);
    PyObject *v = SLOT_MASK(s); /* the table's reference passes to the caller */
    erase(t, i);
    return v;
}

PyDoc_STRVAR(take_referenced_doc,
             "take_referenced(key, /)\n--\n\n"
             "True if a walk matched ``key`` since its flag was last taken; clears the flag.\n"
             "False for an absent key.");

static PyObject *
BlockTable_take_referenced(BlockTable *t, PyObject *key_obj)
{
    uint64_t key;
    if (key_of(key_obj, &key) < 0)
        return NULL;
    Slot *s = &t->slots[find(t, key)];
    if (s->value & REF_BIT) {
        s->value &= ~REF_BIT;
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(clear_doc, "clear()\n--\n\nRemove every entry.");

static PyObject *
BlockTable_clear(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    release_all(t);
    Slot *slots = t->slots;
    t->slots = NULL;
    PyMem_Free(slots);
    if (resize(t, MIN_CAPACITY) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(memory_bytes_doc,
             "memory_bytes()\n--\n\nBytes of the table's object and slot array (masks are shared ints, not counted).");

static PyObject *
BlockTable_memory_bytes(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(BlockTable) + (t->capacity_mask + 1) * sizeof(Slot));
}

PyDoc_STRVAR(walk_doc,
             "walk(keys, alive, /)\n--\n\n"
             "Follow ``keys`` (a prompt's block keys, in order) while some replica of the\n"
             "mask ``alive`` holds every block so far.\n\n"
             "Returns ``(drops, end)``: ``drops`` lists ``(i, bits)`` in order, ``bits`` the\n"
             "replicas of ``alive`` that hold ``keys[:i]`` but not ``keys[i]`` (``i ==\n"
             "len(keys)`` for those that hold every key); ``end`` is the longest match.\n"
             "The keys ``keys[:end]`` get their referenced flag set.");

static PyObject *
BlockTable_walk(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("walk", nargs, 2, 2))
        return NULL;
    PyObject *alive = args[1];
    if (!PyLong_Check(alive)) {
        PyErr_SetString(PyExc_TypeError, "alive must be an int mask");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *drops = PyList_New(0);
    uint64_t *keys = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    size_t *where = PyMem_Malloc((n ? n : 1) * sizeof(size_t));
    PyObject *result = NULL;
    Py_INCREF(alive);
    if (drops == NULL || keys == NULL || where == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t m = t->capacity_mask;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (key_of(items[i], &keys[i]) < 0)
            goto done;
        where[i] = (size_t)home_of(keys[i], t->seed) & m;
    }
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        PREFETCH(&t->slots[where[i]]);

    Py_ssize_t end = n;
    PyObject *last = NULL; /* borrowed: the mask of the previous block */
    int alive_nonzero = PyObject_IsTrue(alive);
    if (alive_nonzero <= 0) {
        end = 0;
        if (alive_nonzero < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n && alive_nonzero; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH(&t->slots[where[i + PREFETCH_AHEAD]]);
        size_t j = where[i];
        uint64_t key = keys[i];
        while (t->slots[j].value && t->slots[j].key != key)
            j = (j + 1) & m;
        where[i] = j;
        PyObject *mask = t->slots[j].value ? SLOT_MASK(&t->slots[j]) : NULL;
        if (mask != NULL && mask == last)
            continue; /* a run of blocks with the same holders: nothing drops */
        last = mask;
        PyObject *held = mask ? PyNumber_And(mask, alive) : PyLong_FromLong(0);
        if (held == NULL)
            goto done;
        int same = PyObject_RichCompareBool(held, alive, Py_EQ);
        if (same < 0) {
            Py_DECREF(held);
            goto done;
        }
        if (same) {
            Py_DECREF(held);
            continue;
        }
        PyObject *dropped = PyNumber_Xor(alive, held);
        PyObject *entry = dropped ? Py_BuildValue("(nN)", i, dropped) : NULL;
        if (entry == NULL || PyList_Append(drops, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(held);
            goto done;
        }
        Py_DECREF(entry);
        Py_DECREF(alive);
        alive = held;
        alive_nonzero = PyObject_IsTrue(alive);
        if (alive_nonzero < 0)
            goto done;
        if (!alive_nonzero)
            end = i;
    }
    if (alive_nonzero) {
        PyObject *entry = Py_BuildValue("(nO)", n, alive);
        if (entry == NULL || PyList_Append(drops, entry) < 0) {
            Py_XDECREF(entry);
            goto done;
        }
        Py_DECREF(entry);
    }
    for (Py_ssize_t i = 0; i < end; i++) /* keys[:end] are all present: their slots were found above */
        t->slots[where[i]].value |= REF_BIT;
    result = Py_BuildValue("(On)", drops, end);
done:
    Py_DECREF(alive);
    Py_XDECREF(drops);
    Py_DECREF(seq);
    PyMem_Free(keys);
    PyMem_Free(where);
    return result;
}

static PyMethodDef BlockTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockTable_get, METH_FASTCALL, get_doc},
    {"pop", (PyCFunction)(void (*)(void))BlockTable_pop, METH_FASTCALL, pop_doc},
    {"take_referenced", (PyCFunction)BlockTable_take_referenced, METH_O, take_referenced_doc},
    {"clear", (PyCFunction)BlockTable_clear, METH_NOARGS, clear_doc},
    {"memory_bytes", (PyCFunction)BlockTable_memory_bytes, METH_NOARGS, memory_bytes_doc},
    {"walk", (PyCFunction)(void (*)(void))BlockTable_walk, METH_FASTCALL, walk_doc},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods BlockTable_as_mapping = {
    .mp_length = (lenfunc)BlockTable_len,
    .mp_subscript = (binaryfunc)BlockTable_subscript,
    .mp_ass_subscript = (objobjargproc)BlockTable_ass_subscript,
};

static PySequenceMethods BlockTable_as_sequence = {
    .sq_contains = (objobjproc)BlockTable_contains,
};

PyDoc_STRVAR(BlockTable_doc,
             "BlockTable(seed=0)\n--\n\n"
             "Map of 64-bit block keys (ints in [0, 2**64)) to int masks, with a\n"
             "referenced flag per key.  ``seed`` (64-bit) scatters keys over slots;\n"
             "pass a random one.  Bad keys raise TypeError / OverflowError, non-int\n"
             "values TypeError.");

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "routing._blocktable.BlockTable",
    .tp_basicsize = sizeof(BlockTable),
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_as_sequence = &BlockTable_as_sequence,
    .tp_as_mapping = &BlockTable_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = BlockTable_doc,
    .tp_methods = BlockTable_methods,
    .tp_new = BlockTable_new,
};

static struct PyModuleDef blocktable_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "routing._blocktable",
    .m_doc = "The block index's key -> holders hash table (see routing.index).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__blocktable(void)
{
    if (PyType_Ready(&BlockTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&blocktable_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BlockTableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(&BlockTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
