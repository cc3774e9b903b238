/*
 * routing._blocktable: the block index's key -> holders map, in C.
 *
 * BlockTable maps a 64-bit block key (routing.block_keys) to a Python int
 * (the bit mask of the replicas holding the block).  It is an
 * open-addressing hash table with linear probing and backward-shift
 * deletion: each entry is one 16-byte slot {key, mask pointer | flag}, so a
 * probe touches one cache line instead of a dict's index, entry and key
 * object (about three cache misses a lookup in a dict of 10^5 int keys).
 * walk() runs a prompt's whole lookup in C and prefetches the slots of the
 * keys ahead of the one being compared; add() and remove() fold one relay
 * key event in (keys as uint64 bytes, no Python int made a key), and
 * clear_bit() drops a replica in one pass.
 *
 * Predictions maps (block key, replica slot) to the expiry of that replica's
 * blind-window prediction (24-byte slots, same probing); BlockTable.predict()
 * and BlockTable.expire() keep it and the masks in step.
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

/* Insert an absent key (slot i was returned by find) with a borrowed mask; may resize. */
static int
insert_at(BlockTable *t, size_t i, uint64_t key, PyObject *mask)
{
    if ((size_t)(t->used + 1) * 2 > t->capacity_mask + 1) {
        if (resize(t, (t->capacity_mask + 1) * 2) < 0)
            return -1;
        i = find(t, key);
    }
    t->slots[i].key = key;
    t->slots[i].value = (uintptr_t)Py_NewRef(mask);
    t->used++;
    return 0;
}

/* 1 if key's mask has a bit of `bit`, 0 if not (or key absent), -1 on error. */
static int
has_bit(BlockTable *t, uint64_t key, PyObject *bit)
{
    Slot *s = &t->slots[find(t, key)];
    if (!s->value)
        return 0;
    PyObject *both = PyNumber_And(SLOT_MASK(s), bit);
    if (both == NULL)
        return -1;
    int has = PyObject_IsTrue(both);
    Py_DECREF(both);
    return has;
}

/* key's mask |= bit (inserting key if absent), the result interned in `masks`. */
/* masks.setdefault(m, m) (borrowed), refusing anything but an exact int. */
static PyObject *
intern_mask(PyObject *masks, PyObject *m)
{
    PyObject *interned = PyDict_SetDefault(masks, m, m);
    if (interned != NULL && !PyLong_CheckExact(interned)) {
        PyErr_SetString(PyExc_TypeError, "masks must map ints to themselves");
        return NULL;
    }
    return interned;
}

static int
or_bit(BlockTable *t, uint64_t key, PyObject *bit, PyObject *masks)
{
    size_t j = find(t, key);
    Slot *s = &t->slots[j];
    PyObject *grown = s->value ? PyNumber_Or(SLOT_MASK(s), bit) : Py_NewRef(bit);
    if (grown == NULL)
        return -1;
    PyObject *interned = intern_mask(masks, grown); /* borrowed */
    Py_DECREF(grown);
    if (interned == NULL)
        return -1;
    j = find(t, key); /* the dict call may have run Python code: look the slot up again */
    s = &t->slots[j];
    if (!s->value)
        return insert_at(t, j, key, interned);
    PyObject *old = SLOT_MASK(s);
    s->value = (uintptr_t)Py_NewRef(interned) | (s->value & REF_BIT);
    Py_DECREF(old);
    return 0;
}

/* key's mask &= not_bit (~bit), interned; the key goes when no bit is left. */
static int
clear_bit(BlockTable *t, uint64_t key, PyObject *bit, PyObject *not_bit, PyObject *masks)
{
    size_t j = find(t, key);
    Slot *s = &t->slots[j];
    if (!s->value)
        return 0;
    PyObject *old = SLOT_MASK(s);
    int only = PyObject_RichCompareBool(old, bit, Py_EQ); /* the common case: no other holder */
    if (only < 0)
        return -1;
    if (only) {
        erase(t, j);
        Py_DECREF(old);
        return 0;
    }
    PyObject *rest = PyNumber_And(old, not_bit);
    if (rest == NULL)
        return -1;
    int any = PyObject_IsTrue(rest);
    if (any <= 0) {
        Py_DECREF(rest);
        if (any < 0)
            return -1;
        erase(t, j);
        Py_DECREF(old);
        return 0;
    }
    PyObject *interned = intern_mask(masks, rest); /* borrowed */
    Py_DECREF(rest);
    if (interned == NULL)
        return -1;
    s = &t->slots[find(t, key)]; /* the dict call may have run Python code: look the slot up again */
    if (!s->value)
        return 0;
    old = SLOT_MASK(s);
    s->value = (uintptr_t)Py_NewRef(interned) | (s->value & REF_BIT);
    Py_DECREF(old);
    return 0;
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
    return insert_at(t, i, key, value);
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

PyDoc_STRVAR(clear_doc, "clear()\n--\n\nRemove every entry.");

static PyObject *
BlockTable_clear(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    Slot *fresh = PyMem_Calloc(MIN_CAPACITY, sizeof(Slot));
    if (fresh == NULL)
        return PyErr_NoMemory();
    release_all(t);
    PyMem_Free(t->slots);
    t->slots = fresh;
    t->capacity_mask = MIN_CAPACITY - 1;
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
             "len(keys)`` for those that hold every key); ``end`` is the longest match.");

static PyObject *
BlockTable_walk(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("walk", nargs, 2, 2))
        return NULL;
    PyObject *alive = args[1];
    if (!PyLong_CheckExact(alive)) {
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
    result = Py_BuildValue("(On)", drops, end);
done:
    Py_DECREF(alive);
    Py_XDECREF(drops);
    Py_DECREF(seq);
    PyMem_Free(keys);
    PyMem_Free(where);
    return result;
}

/* ------------------------------------------------------------ predictions */

/* (block key, replica slot) -> expiry of that replica's prediction of the block. */
typedef struct {
    uint64_t key;
    uint32_t replica;
    uint32_t occupied;
    double until;
} PSlot;

typedef struct {
    PyObject_HEAD
    PSlot *slots;
    size_t capacity_mask;
    Py_ssize_t used;
    uint64_t seed;
} Predictions;

static PyTypeObject PredictionsType;

static inline size_t
p_home(const Predictions *p, uint64_t key, uint32_t replica)
{
    return (size_t)home_of(key ^ ((uint64_t)(replica + 1) * 0x9E3779B97F4A7C15ULL), p->seed) & p->capacity_mask;
}

static inline size_t
p_find(const Predictions *p, uint64_t key, uint32_t replica)
{
    size_t i = p_home(p, key, replica);
    for (;;) {
        const PSlot *s = &p->slots[i];
        if (!s->occupied || (s->key == key && s->replica == replica))
            return i;
        i = (i + 1) & p->capacity_mask;
    }
}

static int
p_resize(Predictions *p, size_t capacity)
{
    PSlot *fresh = PyMem_Calloc(capacity, sizeof(PSlot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PSlot *old = p->slots;
    size_t old_capacity = old ? p->capacity_mask + 1 : 0;
    p->slots = fresh;
    p->capacity_mask = capacity - 1;
    for (size_t j = 0; j < old_capacity; j++) {
        if (old[j].occupied)
            p->slots[p_find(p, old[j].key, old[j].replica)] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

static void
p_erase(Predictions *p, size_t i)
{
    size_t m = p->capacity_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & m;
        PSlot *s = &p->slots[j];
        if (!s->occupied)
            break;
        size_t h = p_home(p, s->key, s->replica);
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            p->slots[i] = *s;
            i = j;
        }
    }
    memset(&p->slots[i], 0, sizeof(PSlot));
    p->used--;
}

/* Set (key, replica) -> until; 1 if it was new, 0 if extended, -1 on error. */
static int
p_set(Predictions *p, uint64_t key, uint32_t replica, double until)
{
    size_t i = p_find(p, key, replica);
    if (p->slots[i].occupied) {
        p->slots[i].until = until;
        return 0;
    }
    if ((size_t)(p->used + 1) * 2 > p->capacity_mask + 1) {
        if (p_resize(p, (p->capacity_mask + 1) * 2) < 0)
            return -1;
        i = p_find(p, key, replica);
    }
    p->slots[i].key = key;
    p->slots[i].replica = replica;
    p->slots[i].occupied = 1;
    p->slots[i].until = until;
    p->used++;
    return 1;
}

static PyObject *
Predictions_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|K:Predictions", kwlist, &seed))
        return NULL;
    Predictions *p = (Predictions *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->seed = (uint64_t)seed;
    p->slots = NULL;
    p->used = 0;
    if (p_resize(p, MIN_CAPACITY) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static void
Predictions_dealloc(Predictions *p)
{
    PyMem_Free(p->slots);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static Py_ssize_t
Predictions_len(Predictions *p)
{
    return p->used;
}

static int
replica_of(PyObject *obj, uint32_t *out)
{
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > UINT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "replica slot out of range");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

PyDoc_STRVAR(p_until_doc, "until(key, replica, /)\n--\n\nExpiry of ``replica``'s prediction of ``key``, or None.");

static PyObject *
Predictions_until(Predictions *p, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t key;
    uint32_t replica;
    if (!check_nargs("until", nargs, 2, 2) || key_of(args[0], &key) < 0 || replica_of(args[1], &replica) < 0)
        return NULL;
    PSlot *s = &p->slots[p_find(p, key, replica)];
    if (!s->occupied)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(s->until);
}

PyDoc_STRVAR(p_discard_doc,
             "discard(key, replica, /)\n--\n\nForget ``replica``'s prediction of ``key``; True if there was one.");

static PyObject *
Predictions_discard(Predictions *p, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t key;
    uint32_t replica;
    if (!check_nargs("discard", nargs, 2, 2) || key_of(args[0], &key) < 0 || replica_of(args[1], &replica) < 0)
        return NULL;
    size_t i = p_find(p, key, replica);
    if (!p->slots[i].occupied)
        Py_RETURN_FALSE;
    p_erase(p, i);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(p_clear_replica_doc,
             "clear_replica(replica, /)\n--\n\nForget every prediction of ``replica``; returns their keys (a list).\n"
             "Scans the whole table: for rare events (a replica cleared or gone).");

static PyObject *
Predictions_clear_replica(Predictions *p, PyObject *arg)
{
    uint32_t replica;
    if (replica_of(arg, &replica) < 0)
        return NULL;
    PyObject *keys = PyList_New(0);
    if (keys == NULL)
        return NULL;
    size_t capacity = p->capacity_mask + 1;
    for (size_t j = 0; j < capacity; j++) {
        if (!p->slots[j].occupied || p->slots[j].replica != replica)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(p->slots[j].key);
        if (k == NULL || PyList_Append(keys, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(keys);
            return NULL;
        }
        Py_DECREF(k);
    }
    /* Erase after collecting: backward shifts move entries, so scan-and-erase could skip some. */
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(keys, i));
        size_t at = p_find(p, key, replica);
        if (p->slots[at].occupied)
            p_erase(p, at);
    }
    return keys;
}

PyDoc_STRVAR(p_memory_bytes_doc, "memory_bytes()\n--\n\nBytes of the object and its slot array.");

static PyObject *
Predictions_memory_bytes(Predictions *p, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(Predictions) + (p->capacity_mask + 1) * sizeof(PSlot));
}

static PyMethodDef Predictions_methods[] = {
    {"until", (PyCFunction)(void (*)(void))Predictions_until, METH_FASTCALL, p_until_doc},
    {"discard", (PyCFunction)(void (*)(void))Predictions_discard, METH_FASTCALL, p_discard_doc},
    {"clear_replica", (PyCFunction)Predictions_clear_replica, METH_O, p_clear_replica_doc},
    {"memory_bytes", (PyCFunction)Predictions_memory_bytes, METH_NOARGS, p_memory_bytes_doc},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods Predictions_as_mapping = {
    .mp_length = (lenfunc)Predictions_len,
};

PyDoc_STRVAR(Predictions_doc,
             "Predictions(seed=0)\n--\n\n"
             "The blind window's expiries: (block key, replica slot) -> until (float seconds).\n"
             "Filled and drained by ``BlockTable.predict`` / ``BlockTable.expire``.");

static PyTypeObject PredictionsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "routing._blocktable.Predictions",
    .tp_basicsize = sizeof(Predictions),
    .tp_dealloc = (destructor)Predictions_dealloc,
    .tp_as_mapping = &Predictions_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Predictions_doc,
    .tp_methods = Predictions_methods,
    .tp_new = Predictions_new,
};

/* The arguments predict() and expire() share: (predictions, _, bit, replica, seconds, masks). */
static int
window_args(const char *name, PyObject *const *args, Py_ssize_t nargs, Predictions **preds, uint32_t *replica,
            double *seconds)
{
    if (!check_nargs(name, nargs, 6, 6))
        return -1;
    if (!PyObject_TypeCheck(args[0], &PredictionsType) || !PyLong_CheckExact(args[2]) || !PyDict_Check(args[5])) {
        PyErr_Format(PyExc_TypeError, "%s(predictions: Predictions, keys, bit: int, replica: int, time: float, "
                     "masks: dict)", name);
        return -1;
    }
    if (replica_of(args[3], replica) < 0)
        return -1;
    *seconds = PyFloat_AsDouble(args[4]);
    if (*seconds == -1.0 && PyErr_Occurred())
        return -1;
    *preds = (Predictions *)args[0];
    return 0;
}

PyDoc_STRVAR(predict_doc,
             "predict(predictions, keys, bit, replica, until, masks, /)\n--\n\n"
             "Record that the replica (mask ``bit``, slot ``replica``) will hold ``keys`` until\n"
             "``until`` (``routing.index``'s blind window; ``self`` holds the real-or-predicted\n"
             "masks).  A key whose mask lacks ``bit`` gets it (interned through\n"
             "``masks.setdefault``) and a prediction; a key the replica holds by an earlier\n"
             "prediction gets the new ``until``; a key it really holds is left alone.\n\n"
             "Returns ``(new, tracked)``: keys newly predicted, and the uint64-LE ``bytes``\n"
             "of the keys whose ``until`` was set (new and extended), for ``expire``.");

static PyObject *
BlockTable_predict(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Predictions *preds;
    uint32_t replica;
    double until;
    if (window_args("predict", args, nargs, &preds, &replica, &until) < 0)
        return NULL;
    PyObject *bit = args[2], *masks = args[5];
    PyObject *keys = PySequence_Fast(args[1], "keys must be a sequence of ints");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), fresh = 0, count = 0;
    PyObject **ks = PySequence_Fast_ITEMS(keys);
    uint64_t *all = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    uint64_t *tracked = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    PyObject *result = NULL;
    if (all == NULL || tracked == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (key_of(ks[i], &all[i]) < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) { /* both tables' slots of a key further on: the misses overlap */
            uint64_t ahead = all[i + PREFETCH_AHEAD];
            PREFETCH(&t->slots[(size_t)home_of(ahead, t->seed) & t->capacity_mask]);
            PREFETCH(&preds->slots[p_home(preds, ahead, replica)]);
        }
        uint64_t key = all[i];
        int held = has_bit(t, key, bit);
        if (held < 0)
            goto done;
        if (held) {
            size_t at = p_find(preds, key, replica);
            if (!preds->slots[at].occupied)
                continue; /* really held */
            preds->slots[at].until = until;
        }
        else {
            if (p_set(preds, key, replica, until) < 0 || or_bit(t, key, bit, masks) < 0)
                goto done;
            fresh++;
        }
        tracked[count++] = key;
    }
    result = Py_BuildValue("(ny#)", fresh, (const char *)tracked, (Py_ssize_t)(count * sizeof(uint64_t)));
done:
    PyMem_Free(all);
    PyMem_Free(tracked);
    Py_DECREF(keys);
    return result;
}

PyDoc_STRVAR(expire_doc,
             "expire(predictions, tracked, bit, replica, now, masks, /)\n--\n\n"
             "Retire the replica's predictions of the keys in ``tracked`` (``predict``'s bytes)\n"
             "whose ``until`` is at or before ``now``; confirmed, cleared or extended ones are\n"
             "skipped.  ``bit`` leaves each retired key's mask here.  Returns how many.");

static PyObject *
BlockTable_expire(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Predictions *preds;
    uint32_t replica;
    double now;
    if (window_args("expire", args, nargs, &preds, &replica, &now) < 0)
        return NULL;
    PyObject *bit = args[2], *masks = args[5];
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *not_bit = NULL, *result = NULL;
    uint64_t *keys = NULL;
    if (view.len % sizeof(uint64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "tracked must hold whole uint64 keys");
        goto done;
    }
    not_bit = PyNumber_Invert(bit);
    if (not_bit == NULL)
        goto done;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(uint64_t), expired = 0;
    keys = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t)); /* copied: the buffer need not be 8-byte aligned */
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(keys, view.buf, (size_t)n * sizeof(uint64_t));
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        PREFETCH(&preds->slots[p_home(preds, keys[i], replica)]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            PREFETCH(&preds->slots[p_home(preds, keys[i + PREFETCH_AHEAD], replica)]);
            PREFETCH(&t->slots[(size_t)home_of(keys[i + PREFETCH_AHEAD], t->seed) & t->capacity_mask]);
        }
        size_t at = p_find(preds, keys[i], replica);
        if (!preds->slots[at].occupied || preds->slots[at].until > now)
            continue;
        if (clear_bit(t, keys[i], bit, not_bit, masks) < 0)
            goto done;
        p_erase(preds, p_find(preds, keys[i], replica)); /* the bit is gone: now the prediction */
        expired++;
    }
    result = PyLong_FromSsize_t(expired);
done:
    PyMem_Free(keys);
    Py_XDECREF(not_bit);
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------ key events */

/* A sequence of block keys: a bytes-like of uint64 (native order) or a sequence of ints.
 * Fills *out (PyMem_Malloc'ed, caller frees) and *n. */
static int
keys_arg(PyObject *obj, uint64_t **out, Py_ssize_t *n)
{
    *out = NULL;
    *n = 0;
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
            return -1;
        if (view.len % (Py_ssize_t)sizeof(uint64_t) != 0) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "a bytes-like of keys must hold whole uint64 keys");
            return -1;
        }
        *n = view.len / (Py_ssize_t)sizeof(uint64_t);
        *out = PyMem_Malloc((*n ? *n : 1) * sizeof(uint64_t));
        if (*out == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(*out, view.buf, (size_t)*n * sizeof(uint64_t)); /* need not be 8-byte aligned */
        PyBuffer_Release(&view);
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, "keys must be a bytes-like of uint64 or a sequence of ints");
    if (seq == NULL)
        return -1;
    *n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    *out = PyMem_Malloc((*n ? *n : 1) * sizeof(uint64_t));
    if (*out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (key_of(items[i], &(*out)[i]) < 0) {
            Py_DECREF(seq);
            PyMem_Free(*out);
            *out = NULL;
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* The arguments add() and remove() share: (predictions, keys, bit, replica, masks). */
static int
keys_event_args(const char *name, PyObject *const *args, Py_ssize_t nargs, Predictions **preds, uint32_t *replica)
{
    if (!check_nargs(name, nargs, 5, 5))
        return -1;
    if (!PyObject_TypeCheck(args[0], &PredictionsType) || !PyLong_CheckExact(args[2]) || !PyDict_Check(args[4])) {
        PyErr_Format(PyExc_TypeError, "%s(predictions: Predictions, keys, bit: int, replica: int, masks: dict)",
                     name);
        return -1;
    }
    if (replica_of(args[3], replica) < 0)
        return -1;
    *preds = (Predictions *)args[0];
    return 0;
}

PyDoc_STRVAR(add_doc,
             "add(predictions, keys, bit, replica, masks, /)\n--\n\n"
             "The replica (mask ``bit``, slot ``replica``) now really holds ``keys`` (a\n"
             "``KeysStored`` event: a bytes-like of uint64 keys or a sequence of ints).\n"
             "A key whose mask lacks ``bit`` gets it (interned through ``masks.setdefault``);\n"
             "a key the replica held by prediction keeps its bit and loses the prediction\n"
             "(confirmed); a key it already really held is a duplicate.\n\n"
             "Returns ``(new, confirmed, duplicates)``.  A bad key raises before any change.");

static PyObject *
BlockTable_add(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Predictions *preds;
    uint32_t replica;
    if (keys_event_args("add", args, nargs, &preds, &replica) < 0)
        return NULL;
    PyObject *bit = args[2], *masks = args[4];
    uint64_t *keys;
    Py_ssize_t n, fresh = 0, confirmed = 0, duplicates = 0;
    if (keys_arg(args[1], &keys, &n) < 0)
        return NULL;
    PyObject *result = NULL;
    /* A strong reference: a key's __eq__ run by or_bit's dict call may clear `masks`. */
    PyObject *interned_bit = Py_XNewRef(intern_mask(masks, bit));
    if (interned_bit == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        PREFETCH(&t->slots[(size_t)home_of(keys[i], t->seed) & t->capacity_mask]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH(&t->slots[(size_t)home_of(keys[i + PREFETCH_AHEAD], t->seed) & t->capacity_mask]);
        uint64_t key = keys[i];
        size_t j = find(t, key);
        if (!t->slots[j].value) { /* the common case: nobody holds it yet */
            if (insert_at(t, j, key, interned_bit) < 0)
                goto done;
            fresh++;
            continue;
        }
        int held = SLOT_MASK(&t->slots[j]) == interned_bit ? 1 : has_bit(t, key, bit);
        if (held < 0)
            goto done;
        if (!held) {
            if (or_bit(t, key, bit, masks) < 0)
                goto done;
            fresh++;
            continue;
        }
        size_t at = p_find(preds, key, replica);
        if (preds->slots[at].occupied) {
            p_erase(preds, at);
            confirmed++;
        }
        else
            duplicates++;
    }
    result = Py_BuildValue("(nnn)", fresh, confirmed, duplicates);
done:
    Py_XDECREF(interned_bit);
    PyMem_Free(keys);
    return result;
}

PyDoc_STRVAR(remove_doc,
             "remove(predictions, keys, bit, replica, masks, /)\n--\n\n"
             "The replica (mask ``bit``, slot ``replica``) no longer holds ``keys`` (a\n"
             "``KeysRemoved`` event; same key forms as ``add``).  Each key it really held\n"
             "loses ``bit`` (the key goes when no holder is left).  A key it did not hold,\n"
             "or held only by prediction, is unknown and left alone.\n\n"
             "Returns ``(removed, unknown)``.  A bad key raises before any change.");

static PyObject *
BlockTable_remove(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Predictions *preds;
    uint32_t replica;
    if (keys_event_args("remove", args, nargs, &preds, &replica) < 0)
        return NULL;
    PyObject *bit = args[2], *masks = args[4];
    uint64_t *keys;
    Py_ssize_t n, removed = 0, unknown = 0;
    if (keys_arg(args[1], &keys, &n) < 0)
        return NULL;
    PyObject *result = NULL;
    PyObject *not_bit = PyNumber_Invert(bit);
    if (not_bit == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int held = has_bit(t, keys[i], bit);
        if (held < 0)
            goto done;
        if (!held || preds->slots[p_find(preds, keys[i], replica)].occupied) {
            unknown++;
            continue;
        }
        if (clear_bit(t, keys[i], bit, not_bit, masks) < 0)
            goto done;
        removed++;
    }
    result = Py_BuildValue("(nn)", removed, unknown);
done:
    Py_XDECREF(not_bit);
    PyMem_Free(keys);
    return result;
}

PyDoc_STRVAR(clear_bit_doc,
             "clear_bit(bit, masks, /)\n--\n\n"
             "Drop ``bit`` from every key's mask (a replica cleared or removed; its\n"
             "predictions must be dropped from ``Predictions`` by the caller).  Keys left\n"
             "without a holder go.  One pass over the slots, in C.  Returns how many keys\n"
             "had the bit.");

static PyObject *
BlockTable_clear_bit(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("clear_bit", nargs, 2, 2))
        return NULL;
    PyObject *bit = args[0], *masks = args[1];
    if (!PyLong_CheckExact(bit) || !PyDict_Check(masks)) {
        PyErr_SetString(PyExc_TypeError, "clear_bit(bit: int, masks: dict)");
        return NULL;
    }
    size_t capacity = t->capacity_mask + 1;
    Py_ssize_t count = 0, cap = 1024;
    uint64_t *keys = PyMem_Malloc((size_t)cap * sizeof(uint64_t));
    PyObject *not_bit = NULL, *result = NULL;
    if (keys == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    /* Masks are interned and few: remember the bit test per mask object (direct-mapped
     * by address), so the pass allocates an int per distinct mask, not per slot. */
    enum { CACHE = 64 };
    PyObject *seen[CACHE] = {NULL};
    int seen_has[CACHE] = {0};
    for (size_t j = 0; j < capacity; j++) { /* collect first: erasing shifts slots */
        if (!t->slots[j].value)
            continue;
        PyObject *mask = SLOT_MASK(&t->slots[j]);
        size_t c = ((uintptr_t)mask >> 4) % CACHE;
        int held;
        if (seen[c] == mask) {
            held = seen_has[c];
        }
        else {
            PyObject *both = PyNumber_And(mask, bit);
            if (both == NULL)
                goto done;
            held = PyObject_IsTrue(both);
            Py_DECREF(both);
            if (held < 0)
                goto done;
            seen[c] = mask; /* borrowed: nothing runs Python code before the pass ends */
            seen_has[c] = held;
        }
        if (!held)
            continue;
        if (count == cap) {
            uint64_t *grown = PyMem_Realloc(keys, (size_t)cap * 2 * sizeof(uint64_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            keys = grown;
            cap *= 2;
        }
        keys[count++] = t->slots[j].key;
    }
    not_bit = PyNumber_Invert(bit);
    if (not_bit == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (clear_bit(t, keys[i], bit, not_bit, masks) < 0)
            goto done;
    }
    result = PyLong_FromSsize_t(count);
done:
    Py_XDECREF(not_bit);
    PyMem_Free(keys);
    return result;
}

static PyMethodDef BlockTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockTable_get, METH_FASTCALL, get_doc},
    {"pop", (PyCFunction)(void (*)(void))BlockTable_pop, METH_FASTCALL, pop_doc},
    {"clear", (PyCFunction)BlockTable_clear, METH_NOARGS, clear_doc},
    {"memory_bytes", (PyCFunction)BlockTable_memory_bytes, METH_NOARGS, memory_bytes_doc},
    {"walk", (PyCFunction)(void (*)(void))BlockTable_walk, METH_FASTCALL, walk_doc},
    {"predict", (PyCFunction)(void (*)(void))BlockTable_predict, METH_FASTCALL, predict_doc},
    {"expire", (PyCFunction)(void (*)(void))BlockTable_expire, METH_FASTCALL, expire_doc},
    {"add", (PyCFunction)(void (*)(void))BlockTable_add, METH_FASTCALL, add_doc},
    {"remove", (PyCFunction)(void (*)(void))BlockTable_remove, METH_FASTCALL, remove_doc},
    {"clear_bit", (PyCFunction)(void (*)(void))BlockTable_clear_bit, METH_FASTCALL, clear_bit_doc},
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
             "Map of 64-bit block keys (ints in [0, 2**64)) to int masks.\n"
             "``seed`` (64-bit) scatters keys over slots; pass a random one.  Bad keys raise TypeError / OverflowError, non-int\n"
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
    if (PyType_Ready(&PredictionsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&BlockTableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(&BlockTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PredictionsType);
    if (PyModule_AddObject(m, "Predictions", (PyObject *)&PredictionsType) < 0) {
        Py_DECREF(&PredictionsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
