/*
 * routing._blocktable: the block index's tables, in C.
 *
 * One generic open-addressing hash table (linear probing, backward-shift
 * deletion, load factor at most 1/2, 24-byte slots) serves two kinds of
 * entry:
 *
 *   HOLDERS    block key -> mask of the replicas holding the block (really or
 *              by prediction): a fixed-width bitmask of MAX_REPLICAS bits, so
 *              the hot structure holds no Python objects and no reference
 *              counts.  A key without holders is erased, so "occupied" is
 *              "mask not zero".
 *   PREDICTED  (block key, replica slot) -> expiry of that replica's
 *              blind-window prediction of the block.  The slot is stored + 1,
 *              so "occupied" is "replica field not zero".
 *
 * The kind is a constant argument of the table's functions (find, reserve,
 * erase, insert); the compiler specialises each call.  Slots are placed by
 * fmix64(key ^ tag * GOLDEN ^ seed) (MurmurHash3's 64-bit finaliser; tag 0 for
 * HOLDERS, replica slot + 1 for PREDICTED); the caller passes a random seed so
 * that prompts cannot be crafted to pile up in one probe run.
 *
 * The Python type BlockTable owns one table of each kind and keeps them in
 * step (a replica's bit is in a key's mask by prediction exactly when the
 * PREDICTED table has that (key, replica)): walk() runs a prompt's whole
 * lookup, add() / remove() fold one relay key event in (keys as uint64 bytes
 * or ints), predict() / expire() keep the blind window, clear_replica() drops
 * a replica in one pass, clear_replica_part() in resumable steps.  Every
 * method converts and checks its arguments and reserves the room it may need
 * before it changes anything, so a method that raises leaves both tables as
 * they were; no method runs Python code while it holds a slot index.  Not
 * thread-safe beyond the GIL.
 *
 * A partial clear scans the PREDICTED table, then the HOLDERS table, in slot
 * order, over several calls with other changes in between.  Entries move only
 * two ways: a rehash (grow / shrink) moves them all, and the scan of that
 * table starts over from slot 0; backward-shift deletion moves an entry back
 * within its probe run, possibly from the unscanned part to below the cursor
 * (and, once later deletions have emptied slots between, below the start of
 * the cursor's current run: backing off over that run is not enough).  So
 * each table keeps its scan's cursor (scan_at: no entry below it is the
 * replica's) and erase() lowers it to the slot it moves an entry to from at or
 * above it: the invariant holds whatever ran between two calls.  Inserts never
 * move entries, and nothing gives the replica being cleared an entry again
 * (the caller's promise), so the scanned part stays clean.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_buffers.h"

#define MASK_WORDS 2
#define MAX_REPLICAS (64 * MASK_WORDS)
#define MIN_CAPACITY 64
#define PREFETCH_AHEAD 8
#define GOLDEN 0x9E3779B97F4A7C15ULL

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 1)
#else
#define PREFETCH(p) ((void)(p))
#endif

static PyObject *SIXTY_FOUR; /* the int 64, for mask <-> int conversions */

/* ------------------------------------------------------------------ masks */

typedef struct {
    uint64_t w[MASK_WORDS];
} Mask;

static inline int
mask_any(Mask m)
{
    return (m.w[0] | m.w[1]) != 0;
}

static inline int
mask_eq(Mask a, Mask b)
{
    return a.w[0] == b.w[0] && a.w[1] == b.w[1];
}

static inline Mask
mask_and(Mask a, Mask b)
{
    return (Mask){{a.w[0] & b.w[0], a.w[1] & b.w[1]}};
}

static inline Mask
mask_xor(Mask a, Mask b)
{
    return (Mask){{a.w[0] ^ b.w[0], a.w[1] ^ b.w[1]}};
}

static inline Mask
mask_or(Mask a, Mask b)
{
    return (Mask){{a.w[0] | b.w[0], a.w[1] | b.w[1]}};
}

static inline int
mask_has(Mask m, uint32_t replica)
{
    return (int)((m.w[replica >> 6] >> (replica & 63)) & 1);
}

static inline void
mask_set(Mask *m, uint32_t replica)
{
    m->w[replica >> 6] |= (uint64_t)1 << (replica & 63);
}

static inline void
mask_clear(Mask *m, uint32_t replica)
{
    m->w[replica >> 6] &= ~((uint64_t)1 << (replica & 63));
}

/* A Python int in [0, 2**MAX_REPLICAS) -> Mask; -1 with TypeError / OverflowError. */
static int
mask_from_int(PyObject *arg, Mask *out)
{
    if (!PyLong_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "a replica mask must be an int, not %.100s", Py_TYPE(arg)->tp_name);
        return -1;
    }
    PyObject *obj = PyNumber_Index(arg); /* an exact int: a subclass's own operators never run */
    if (obj == NULL)
        return -1;
    int rc = 0;
    unsigned long long low = PyLong_AsUnsignedLongLong(obj);
    if (!(low == (unsigned long long)-1 && PyErr_Occurred())) {
        *out = (Mask){{(uint64_t)low, 0}};
        goto done;
    }
    rc = -1;
    if (!PyErr_ExceptionMatches(PyExc_OverflowError))
        goto done;
    PyErr_Clear(); /* negative, or wider than 64 bits */
    PyObject *high_obj = PyNumber_Rshift(obj, SIXTY_FOUR);
    if (high_obj == NULL)
        goto done;
    unsigned long long high = PyLong_AsUnsignedLongLong(high_obj); /* negative or too wide: OverflowError */
    Py_DECREF(high_obj);
    if (high == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "a replica mask must be in [0, 2**%d)", MAX_REPLICAS);
        }
        goto done;
    }
    out->w[0] = (uint64_t)PyLong_AsUnsignedLongLongMask(obj);
    out->w[1] = (uint64_t)high;
    rc = PyErr_Occurred() ? -1 : 0;
done:
    Py_DECREF(obj);
    return rc;
}

static PyObject *
mask_to_int(Mask m)
{
    if (m.w[1] == 0)
        return PyLong_FromUnsignedLongLong(m.w[0]);
    PyObject *high = PyLong_FromUnsignedLongLong(m.w[1]);
    PyObject *low = PyLong_FromUnsignedLongLong(m.w[0]);
    PyObject *shifted = high ? PyNumber_Lshift(high, SIXTY_FOUR) : NULL;
    PyObject *both = (shifted && low) ? PyNumber_Or(shifted, low) : NULL;
    Py_XDECREF(high);
    Py_XDECREF(low);
    Py_XDECREF(shifted);
    return both;
}

/* ------------------------------------------------------------------ the generic table */

typedef enum { HOLDERS, PREDICTED } Kind;

typedef struct {
    uint64_t key;
    union {
        Mask holders; /* HOLDERS: the replicas holding the key; never all zero in an occupied slot */
        struct {
            uint64_t replica1; /* PREDICTED: replica slot + 1; 0 = empty slot */
            double until;      /* expiry, seconds on the caller's clock */
        } predicted;
    } v;
} Slot;

_Static_assert(sizeof(Slot) == 24, "a slot is 24 bytes");

typedef struct {
    Slot *slots;
    size_t capacity_mask; /* capacity - 1, capacity a power of two */
    size_t used;
    uint64_t seed;
    size_t scan_at;    /* a partial clear's cursor: no entry in slots [0, scan_at) is the replica's; SIZE_MAX: none */
    uint64_t rehashes; /* capacity changes (grow and shrink) */
} Table;

static inline uint64_t
fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline size_t
home(const Table *t, uint64_t key, uint64_t tag)
{
    return (size_t)fmix64(key ^ (tag * GOLDEN) ^ t->seed) & t->capacity_mask;
}

static inline uint64_t
tag_of(Kind kind, const Slot *s)
{
    return kind == HOLDERS ? 0 : s->v.predicted.replica1;
}

static inline int
occupied(Kind kind, const Slot *s)
{
    return kind == HOLDERS ? mask_any(s->v.holders) : s->v.predicted.replica1 != 0;
}

/* Index of (key, tag)'s slot, or of the empty slot where it would go. */
static inline size_t
find(Kind kind, const Table *t, uint64_t key, uint64_t tag)
{
    size_t i = home(t, key, tag);
    for (;;) {
        const Slot *s = &t->slots[i];
        if (!occupied(kind, s) || (s->key == key && tag_of(kind, s) == tag))
            return i;
        i = (i + 1) & t->capacity_mask;
    }
}

static int
table_init(Table *t, uint64_t seed)
{
    t->slots = PyMem_Calloc(MIN_CAPACITY, sizeof(Slot));
    if (t->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->capacity_mask = MIN_CAPACITY - 1;
    t->used = 0;
    t->seed = seed;
    t->scan_at = SIZE_MAX;
    t->rehashes = 0;
    return 0;
}

/* Move every entry into a fresh array of `capacity` slots; 0, or -1 with MemoryError (unchanged). */
static int
rehash(Kind kind, Table *t, size_t capacity)
{
    Slot *fresh = PyMem_Calloc(capacity, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = t->slots;
    size_t old_capacity = t->capacity_mask + 1;
    t->slots = fresh;
    t->capacity_mask = capacity - 1;
    for (size_t j = 0; t->used > 0 && j < old_capacity; j++) { /* an emptied table: nothing to read */
        if (occupied(kind, &old[j]))
            t->slots[find(kind, t, old[j].key, tag_of(kind, &old[j]))] = old[j];
    }
    PyMem_Free(old);
    t->rehashes++;
    if (t->scan_at != SIZE_MAX)
        t->scan_at = 0; /* every entry moved: a partial clear of this table starts over */
    return 0;
}

/* Grow so that `more` inserts keep the load factor at or below 1/2; 0, or -1 with MemoryError
 * (the table unchanged).  Inserts never grow the table: every method reserves first. */
static int
reserve(Kind kind, Table *t, size_t more)
{
    size_t capacity = t->capacity_mask + 1;
    if (more > (SIZE_MAX / sizeof(Slot)) / 4 - t->used) {
        PyErr_NoMemory();
        return -1;
    }
    size_t need = (t->used + more) * 2;
    if (need <= capacity)
        return 0;
    while (capacity < need)
        capacity *= 2;
    return rehash(kind, t, capacity);
}

/* Of keys[0..n), how many have no entry for tag: an upper bound of the inserts a batch makes. */
static size_t
count_absent(Kind kind, const Table *t, const uint64_t *keys, Py_ssize_t n, uint64_t tag)
{
    size_t absent = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH(&t->slots[home(t, keys[i + PREFETCH_AHEAD], tag)]);
        absent += !occupied(kind, &t->slots[find(kind, t, keys[i], tag)]);
    }
    return absent;
}

/* reserve() for a batch of keys: when the batch's length would cross the load bound, count the
 * keys really absent first (batches mostly repeat keys other replicas hold already), so a
 * table does not double for inserts that never come. */
static int
reserve_for(Kind kind, Table *t, const uint64_t *keys, Py_ssize_t n, uint64_t tag)
{
    if ((t->used + (size_t)n) * 2 <= t->capacity_mask + 1)
        return 0;
    return reserve(kind, t, count_absent(kind, t, keys, n, tag));
}

/* Give memory back once a table is at most 1/8 full: down to load 1/4 (so growing again takes
 * as many inserts), never below MIN_CAPACITY.  Best effort: on MemoryError the table stays. */
static void
shrink(Kind kind, Table *t)
{
    size_t capacity = t->capacity_mask + 1;
    if (capacity <= MIN_CAPACITY || t->used * 8 > capacity)
        return;
    size_t target = MIN_CAPACITY;
    while (target < t->used * 4)
        target *= 2;
    if (target < capacity && rehash(kind, t, target) < 0)
        PyErr_Clear();
}

/* Claim the empty slot i (from find) for key; the caller fills the value.  Room was reserved. */
static inline Slot *
insert_at(Table *t, size_t i, uint64_t key)
{
    Slot *s = &t->slots[i];
    s->key = key;
    t->used++;
    return s;
}

/* Remove the entry in occupied slot i, shifting later entries of its probe run back.  An entry
 * moved from at or above a partial clear's cursor to below it lowers the cursor to its new slot
 * (a move that wraps around the end of the array goes up, never across the cursor). */
static void
erase(Kind kind, Table *t, size_t i)
{
    size_t m = t->capacity_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & m;
        Slot *s = &t->slots[j];
        if (!occupied(kind, s))
            break;
        size_t h = home(t, s->key, tag_of(kind, s));
        /* The entry at j may fill the hole at i unless its home lies in (i, j]. */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            if (i < t->scan_at && j >= t->scan_at)
                t->scan_at = i;
            t->slots[i] = *s;
            i = j;
        }
    }
    memset(&t->slots[i], 0, sizeof(Slot));
    t->used--;
}

static size_t
table_bytes(const Table *t)
{
    return (t->capacity_mask + 1) * sizeof(Slot);
}

/* ------------------------------------------------------------------ arguments */

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

/* An int in [0, max] -> *out; -1 with TypeError / OverflowError naming `what`. */
static int
bounded_int(PyObject *obj, const char *what, unsigned long long max, unsigned long long *out)
{
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj); /* OverflowError if negative or >= 2**64 */
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > max) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "%s must be in [0, %llu]", what, max);
        }
        return -1;
    }
    *out = v;
    return 0;
}

static int
key_of(PyObject *obj, uint64_t *out)
{
    unsigned long long v;
    if (bounded_int(obj, "block key", UINT64_MAX, &v) < 0)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static int
replica_of(PyObject *obj, uint32_t *out)
{
    unsigned long long v;
    if (bounded_int(obj, "replica slot", MAX_REPLICAS - 1, &v) < 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int
seconds_of(PyObject *obj, double *out)
{
    if (!PyFloat_Check(obj) && !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a time must be a float, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = PyFloat_AsDouble(obj);
    if (*out == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(*out)) {
        PyErr_SetString(PyExc_ValueError, "a time must not be NaN");
        return -1;
    }
    return 0;
}

/* A sequence of block keys: a bytes-like of uint64 (native order) or a sequence of ints.
 * Fills *out (PyMem_Malloc'ed, the caller frees) and *n; converts every key before returning. */
static int
keys_arg(PyObject *obj, uint64_t **out, Py_ssize_t *n)
{
    *out = NULL;
    *n = 0;
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        if (uint_buffer(obj, &view, sizeof(uint64_t), "keys") < 0)
            return -1;
        *n = view.len / (Py_ssize_t)sizeof(uint64_t);
        *out = PyMem_Malloc((*n ? (size_t)*n : 1) * sizeof(uint64_t));
        if (*out == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(*out, view.buf, (size_t)*n * sizeof(uint64_t)); /* need not be 8-byte aligned */
        PyBuffer_Release(&view);
        return 0;
    }
    if (!PySequence_Check(obj)) { /* not a set or dict: their order is not the prompt's */
        PyErr_Format(PyExc_TypeError, "keys must be a bytes-like of uint64 or a sequence of ints, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(obj, "keys must be a bytes-like of uint64 or a sequence of ints");
    if (seq == NULL)
        return -1;
    *n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    *out = PyMem_Malloc((*n ? (size_t)*n : 1) * sizeof(uint64_t));
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

/* ------------------------------------------------------------------ BlockTable */

typedef struct {
    PyObject_HEAD
    Table holders;
    Table predicted;
    /* The partial clear in progress (clear_replica_part), if scanning: its replica, its phase (0:
     * the PREDICTED table, 1: the HOLDERS table; the cursor is that table's scan_at) and the
     * token its last call returned. */
    int scanning;
    uint32_t scan_replica;
    int scan_phase;
    unsigned long long scan_token;
} BlockTable;

static PyObject *
BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"seed", NULL};
    PyObject *seed_obj = NULL;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:BlockTable", kwlist, &seed_obj))
        return NULL;
    if (seed_obj != NULL && bounded_int(seed_obj, "seed", UINT64_MAX, &seed) < 0)
        return NULL;
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    /* tp_alloc zeroed both tables; two seeds, so one table's runs say nothing of the other's. */
    if (table_init(&t->holders, (uint64_t)seed) < 0 || table_init(&t->predicted, fmix64((uint64_t)seed ^ GOLDEN)) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
BlockTable_dealloc(BlockTable *t)
{
    PyMem_Free(t->holders.slots);
    PyMem_Free(t->predicted.slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
BlockTable_len(BlockTable *t)
{
    return (Py_ssize_t)t->holders.used;
}

/* The holders slot of key, or NULL (absent, or an error set when the key is bad). */
static const Slot *
holders_slot(BlockTable *t, PyObject *key_obj)
{
    uint64_t key;
    if (key_of(key_obj, &key) < 0)
        return NULL;
    const Slot *s = &t->holders.slots[find(HOLDERS, &t->holders, key, 0)];
    return occupied(HOLDERS, s) ? s : NULL;
}

static int
BlockTable_contains(BlockTable *t, PyObject *key_obj)
{
    if (holders_slot(t, key_obj) != NULL)
        return 1;
    return PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(get_doc, "get(key, default=None, /)\n--\n\n"
                      "The mask (an int, bit ``r`` for replica slot ``r``) of the replicas holding ``key``,\n"
                      "really or by prediction, or ``default`` when none does.");

static PyObject *
BlockTable_get(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("get", nargs, 1, 2))
        return NULL;
    const Slot *s = holders_slot(t, args[0]);
    if (s != NULL)
        return mask_to_int(s->v.holders);
    if (PyErr_Occurred())
        return NULL;
    return Py_NewRef(nargs > 1 ? args[1] : Py_None);
}

PyDoc_STRVAR(until_doc, "until(key, replica, /)\n--\n\n"
                        "Expiry of replica slot ``replica``'s prediction of ``key``, or None when it has none.");

static PyObject *
BlockTable_until(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t key;
    uint32_t replica;
    if (!check_nargs("until", nargs, 2, 2) || key_of(args[0], &key) < 0 || replica_of(args[1], &replica) < 0)
        return NULL;
    const Slot *s = &t->predicted.slots[find(PREDICTED, &t->predicted, key, (uint64_t)replica + 1)];
    if (!occupied(PREDICTED, s))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(s->v.predicted.until);
}

static PyObject *
BlockTable_get_num_predictions(BlockTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(t->predicted.used);
}

static PyObject *
BlockTable_get_capacity(BlockTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(t->holders.capacity_mask + 1);
}

static PyObject *
BlockTable_get_prediction_capacity(BlockTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(t->predicted.capacity_mask + 1);
}

static PyObject *
BlockTable_get_rehashes(BlockTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(t->holders.rehashes + t->predicted.rehashes);
}

PyDoc_STRVAR(memory_bytes_doc, "memory_bytes()\n--\n\n"
                               "Bytes of the object and both slot arrays (24 bytes a slot); O(1).");

static PyObject *
BlockTable_memory_bytes(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(BlockTable) + table_bytes(&t->holders) + table_bytes(&t->predicted));
}

PyDoc_STRVAR(walk_doc,
             "walk(keys, alive, out=None, /)\n--\n\n"
             "Follow ``keys`` (a prompt's block keys, in order: a sequence of ints or a\n"
             "bytes-like of uint64) while some replica of the mask ``alive`` (an int in\n"
             "[0, 2**MAX_REPLICAS)) holds every block so far, really or by prediction.\n\n"
             "Returns ``(drops, end)``: ``drops`` lists ``(i, bits)`` in order, ``bits`` the\n"
             "replicas of ``alive`` that hold ``keys[:i]`` but not ``keys[i]`` (``i ==\n"
             "len(keys)`` for those that hold every key); ``end`` is the longest match.\n\n"
             "With ``out`` (a writable buffer of MAX_REPLICAS int32, e.g. a numpy array):\n"
             "``out[r] = i`` for each replica ``r`` of ``alive`` instead (entries of other\n"
             "replicas are left as they were), and ``drops`` is None: no Python object a\n"
             "replica, for callers that gather the answer into arrays.");

/* Where a walk puts its drops: a list of (i, bits), or per replica bit i in an int32 array. */
typedef struct {
    PyObject *list;
    int32_t *out;
} Sink;

/* Record that the replicas of bits hold exactly the first i keys; -1 with an exception set. */
static int
sink_drop(Sink *sink, Py_ssize_t i, Mask bits)
{
    if (sink->out != NULL) {
        for (int w = 0; w < MASK_WORDS; w++) {
            for (uint64_t x = bits.w[w]; x; x &= x - 1)
                sink->out[64 * w + __builtin_ctzll(x)] = (int32_t)i;
        }
        return 0;
    }
    PyObject *b = mask_to_int(bits);
    PyObject *entry = b ? Py_BuildValue("(nN)", i, b) : NULL;
    if (entry == NULL || PyList_Append(sink->list, entry) < 0) {
        Py_XDECREF(entry);
        return -1;
    }
    Py_DECREF(entry);
    return 0;
}

/* A sink from an optional out argument (None or absent: a new list). 0, or -1 with an exception set;
 * on success release it with sink_release. */
static int
sink_init(Sink *sink, Py_buffer *view, PyObject *out, const char *name)
{
    sink->list = NULL;
    sink->out = NULL;
    view->obj = NULL;
    if (out == NULL || out == Py_None) {
        sink->list = PyList_New(0);
        return sink->list == NULL ? -1 : 0;
    }
    if (PyObject_GetBuffer(out, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '=' || *f == '<' || *f == '@')
        f++;
    if (view->itemsize != 4 || (strcmp(f, "i") != 0 && strcmp(f, "l") != 0) || view->len < 4 * MAX_REPLICAS) {
        PyErr_Format(PyExc_TypeError, "%s must be a writable buffer of at least %d int32, got format %s, "
                     "%zd bytes", name, MAX_REPLICAS, view->format ? view->format : "B", view->len);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    sink->out = (int32_t *)view->buf;
    return 0;
}

static void
sink_release(Sink *sink, Py_buffer *view)
{
    Py_XDECREF(sink->list);
    if (view->obj != NULL)
        PyBuffer_Release(view);
}

/* The sink's answer: its list, or None for an array (a new reference). */
static PyObject *
sink_result(Sink *sink)
{
    PyObject *r = sink->list ? sink->list : Py_None;
    Py_INCREF(r);
    return r;
}

static PyObject *
BlockTable_walk(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("walk", nargs, 2, 3))
        return NULL;
    Mask alive;
    if (mask_from_int(args[1], &alive) < 0)
        return NULL;
    Sink sink;
    Py_buffer view;
    if (sink_init(&sink, &view, nargs > 2 ? args[2] : NULL, "out") < 0)
        return NULL;
    uint64_t *keys = NULL;
    Py_ssize_t n;
    PyObject *result = NULL, *drops = NULL;
    if (keys_arg(args[0], &keys, &n) < 0)
        goto done;
    const Table *h = &t->holders;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        PREFETCH(&h->slots[home(h, keys[i], 0)]);
    Py_ssize_t end = mask_any(alive) ? n : 0;
    Mask last = {{0, 0}}; /* the previous block's holders: a run of equal masks drops nothing */
    for (Py_ssize_t i = 0; i < n && mask_any(alive); i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH(&h->slots[home(h, keys[i + PREFETCH_AHEAD], 0)]);
        const Slot *s = &h->slots[find(HOLDERS, h, keys[i], 0)];
        Mask holders = s->v.holders; /* all zero when the slot is empty */
        if (i > 0 && mask_eq(holders, last))
            continue;
        last = holders;
        Mask held = mask_and(holders, alive);
        if (mask_eq(held, alive))
            continue;
        if (sink_drop(&sink, i, mask_xor(alive, held)) < 0)
            goto done;
        alive = held;
        if (!mask_any(alive))
            end = i;
    }
    if (mask_any(alive) && sink_drop(&sink, n, alive) < 0)
        goto done;
    drops = sink_result(&sink);
    result = Py_BuildValue("(Nn)", drops, end);
done:
    sink_release(&sink, &view);
    PyMem_Free(keys);
    return result;
}

static PyTypeObject BlockTableType;

PyDoc_STRVAR(walk_tiers_doc,
             "walk_tiers(keys, alive, host, out=None, host_out=None, /)\n--\n\n"
             "``walk`` over two KV-cache tiers: this table (GPU, blocks held really or by\n"
             "prediction) and ``host`` (a BlockTable of the blocks held in host memory).  A\n"
             "replica of ``alive`` follows ``keys`` on GPU while it holds every block so far\n"
             "there; from its first GPU miss on, it follows them on the host tier while it\n"
             "holds each next block there (vLLM's offloading connector loads the blocks that\n"
             "follow the GPU hit from host memory).\n\n"
             "Returns ``(drops, host_drops)``: ``drops`` as ``walk``'s (where each replica's\n"
             "GPU run ends); ``host_drops`` lists ``(i, bits)`` in order, ``bits`` the\n"
             "replicas whose run, GPU then host, ends at ``i`` (``len(keys)`` for those that\n"
             "hold every key).  With ``out`` and ``host_out`` (both, as ``walk``'s ``out``):\n"
             "each replica of ``alive`` gets its GPU run's end in ``out`` and its run's end\n"
             "in ``host_out``, and both lists are None.");

static PyObject *
BlockTable_walk_tiers(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_nargs("walk_tiers", nargs, 3, 5))
        return NULL;
    if (!PyObject_TypeCheck(args[2], &BlockTableType)) {
        PyErr_Format(PyExc_TypeError, "host must be a BlockTable, not %.100s", Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    PyObject *out = nargs > 3 ? args[3] : Py_None, *host_out = nargs > 4 ? args[4] : Py_None;
    if ((out == Py_None) != (host_out == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "walk_tiers takes both out and host_out, or neither");
        return NULL;
    }
    Mask gpu_alive;
    if (mask_from_int(args[1], &gpu_alive) < 0)
        return NULL;
    Sink sink, host_sink;
    Py_buffer view, host_view;
    if (sink_init(&sink, &view, out, "out") < 0)
        return NULL;
    if (sink_init(&host_sink, &host_view, host_out, "host_out") < 0) {
        sink_release(&sink, &view);
        return NULL;
    }
    uint64_t *keys = NULL;
    Py_ssize_t n;
    PyObject *result = NULL;
    if (keys_arg(args[0], &keys, &n) < 0)
        goto done;
    const Table *g = &t->holders, *h = &((BlockTable *)args[2])->holders;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) {
        PREFETCH(&g->slots[home(g, keys[i], 0)]);
        PREFETCH(&h->slots[home(h, keys[i], 0)]);
    }
    Mask host_alive = {{0, 0}};
    Mask last_gpu = {{0, 0}}, last_host = {{0, 0}}; /* a block with both masks as the last one's changes nothing */
    Py_ssize_t i = 0;
    for (; i < n && (mask_any(gpu_alive) || mask_any(host_alive)); i++) {
        if (i + PREFETCH_AHEAD < n) {
            PREFETCH(&g->slots[home(g, keys[i + PREFETCH_AHEAD], 0)]);
            PREFETCH(&h->slots[home(h, keys[i + PREFETCH_AHEAD], 0)]);
        }
        Mask on_gpu = g->slots[find(HOLDERS, g, keys[i], 0)].v.holders; /* all zero when the slot is empty */
        Mask on_host = h->slots[find(HOLDERS, h, keys[i], 0)].v.holders;
        if (i > 0 && mask_eq(on_gpu, last_gpu) && mask_eq(on_host, last_host))
            continue;
        last_gpu = on_gpu;
        last_host = on_host;
        Mask stay_gpu = mask_and(gpu_alive, on_gpu);
        Mask left_gpu = mask_xor(gpu_alive, stay_gpu);
        if (mask_any(left_gpu) && sink_drop(&sink, i, left_gpu) < 0)
            goto done;
        Mask on_tier2 = mask_or(host_alive, left_gpu); /* replicas that go on from host memory */
        Mask stay_host = mask_and(on_tier2, on_host);
        Mask left = mask_xor(on_tier2, stay_host);
        if (mask_any(left) && sink_drop(&host_sink, i, left) < 0)
            goto done;
        gpu_alive = stay_gpu;
        host_alive = stay_host;
    }
    if (mask_any(gpu_alive) && sink_drop(&sink, n, gpu_alive) < 0)
        goto done;
    Mask to_end = mask_or(gpu_alive, host_alive);
    if (mask_any(to_end) && sink_drop(&host_sink, n, to_end) < 0)
        goto done;
    PyObject *a = sink_result(&sink), *b = sink_result(&host_sink);
    result = Py_BuildValue("(NN)", a, b);
done:
    sink_release(&sink, &view);
    sink_release(&host_sink, &host_view);
    PyMem_Free(keys);
    return result;
}

/* Drop replica's bit from the holders of key; the key goes when no holder is left. 1 if it had the bit. */
static int
drop_holder(Table *h, uint64_t key, uint32_t replica)
{
    size_t j = find(HOLDERS, h, key, 0);
    Slot *s = &h->slots[j];
    if (!occupied(HOLDERS, s) || !mask_has(s->v.holders, replica))
        return 0;
    mask_clear(&s->v.holders, replica);
    if (!mask_any(s->v.holders))
        erase(HOLDERS, h, j);
    return 1;
}

/* The arguments of add / remove / predict / expire: (keys, replica[, seconds]). */
static int
event_args(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, uint64_t **keys,
           Py_ssize_t *n, uint32_t *replica, double *seconds)
{
    *keys = NULL;
    if (!check_nargs(name, nargs, want, want) || replica_of(args[1], replica) < 0)
        return -1;
    if (seconds != NULL && seconds_of(args[2], seconds) < 0)
        return -1;
    return keys_arg(args[0], keys, n);
}

PyDoc_STRVAR(add_doc,
             "add(keys, replica, room, /)\n--\n\n"
             "Replica slot ``replica`` now really holds ``keys`` (a ``KeysStored`` event: a\n"
             "bytes-like of uint64 keys or a sequence of ints).  A key the replica did not\n"
             "hold gets its bit; a key it held by prediction keeps the bit and loses the\n"
             "prediction (confirmed); a key it already really held is a duplicate.  Once\n"
             "``room`` keys were new or confirmed, the rest that would be are refused (the\n"
             "index's cap on entries), in order.\n\n"
             "Returns ``(new, confirmed, duplicates, refused)``.  Raises TypeError /\n"
             "OverflowError / ValueError (bad key, slot or room) or MemoryError before any change.");

static PyObject *
BlockTable_add(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *keys;
    Py_ssize_t n;
    uint32_t replica;
    unsigned long long room;
    if (!check_nargs("add", nargs, 3, 3) || bounded_int(args[2], "room", PY_SSIZE_T_MAX, &room) < 0)
        return NULL;
    if (event_args("add", args, nargs, 3, &keys, &n, &replica, NULL) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t fresh = 0, confirmed = 0, duplicates = 0, refused = 0;
    Table *h = &t->holders, *p = &t->predicted;
    if (reserve_for(HOLDERS, h, keys, n, 0) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        PREFETCH(&h->slots[home(h, keys[i], 0)]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            PREFETCH(&h->slots[home(h, keys[i + PREFETCH_AHEAD], 0)]);
        int full = (unsigned long long)(fresh + confirmed) >= room;
        size_t j = find(HOLDERS, h, keys[i], 0);
        Slot *s = &h->slots[j];
        if (occupied(HOLDERS, s) && mask_has(s->v.holders, replica)) {
            size_t at = find(PREDICTED, p, keys[i], (uint64_t)replica + 1);
            if (!occupied(PREDICTED, &p->slots[at]))
                duplicates++;
            else if (full)
                refused++; /* stays a prediction, and expires as one */
            else {
                erase(PREDICTED, p, at);
                confirmed++;
            }
            continue;
        }
        if (full) {
            refused++;
            continue;
        }
        if (!occupied(HOLDERS, s))
            s = insert_at(h, j, keys[i]); /* the common case: nobody holds it yet */
        mask_set(&s->v.holders, replica);
        fresh++;
    }
    shrink(PREDICTED, p);
    result = Py_BuildValue("(nnnn)", fresh, confirmed, duplicates, refused);
done:
    PyMem_Free(keys);
    return result;
}

PyDoc_STRVAR(remove_doc,
             "remove(keys, replica, /)\n--\n\n"
             "Replica slot ``replica`` no longer holds ``keys`` (a ``KeysRemoved`` event; same\n"
             "key forms as ``add``).  Each key it really held loses its bit (the key goes\n"
             "when no holder is left).  A key it did not hold, or held only by prediction,\n"
             "is unknown and left alone.\n\n"
             "Returns ``(removed, unknown)``.  Bad arguments raise before any change.");

static PyObject *
BlockTable_remove(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *keys;
    Py_ssize_t n;
    uint32_t replica;
    if (event_args("remove", args, nargs, 2, &keys, &n, &replica, NULL) < 0)
        return NULL;
    Py_ssize_t removed = 0, unknown = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Slot *prediction = &t->predicted.slots[find(PREDICTED, &t->predicted, keys[i], (uint64_t)replica + 1)];
        if (occupied(PREDICTED, prediction) || !drop_holder(&t->holders, keys[i], replica))
            unknown++;
        else
            removed++;
    }
    PyMem_Free(keys);
    shrink(HOLDERS, &t->holders);
    return Py_BuildValue("(nn)", removed, unknown);
}

PyDoc_STRVAR(predict_doc,
             "predict(keys, replica, until, /)\n--\n\n"
             "Record that replica slot ``replica`` will hold ``keys`` until ``until`` (seconds,\n"
             "not NaN; the blind window of ``routing.index``).  A key whose mask lacks the\n"
             "replica gets its bit and a prediction; a key it holds by an earlier prediction\n"
             "gets the new ``until``; a key it really holds is left alone.\n\n"
             "Returns ``(new, tracked)``: keys newly predicted, and the uint64 ``bytes`` of the\n"
             "keys whose ``until`` was set (new and extended), for ``expire``.  Bad arguments\n"
             "raise, and ``tracked`` and the room are allocated, before any change.");

static PyObject *
BlockTable_predict(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *keys;
    Py_ssize_t n;
    uint32_t replica;
    double until;
    if (event_args("predict", args, nargs, 3, &keys, &n, &replica, &until) < 0)
        return NULL;
    PyObject *result = NULL, *tracked = NULL;
    Table *h = &t->holders, *p = &t->predicted;
    uint64_t tag = (uint64_t)replica + 1;
    /* A read-only pass first: predict never makes a key really held, so the keys it will track
     * are those not really held now, and the inserts are at most the keys absent now. */
    Py_ssize_t count = 0;
    size_t holder_inserts = 0, prediction_inserts = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) { /* both tables' slots of a key further on: the misses overlap */
            PREFETCH(&h->slots[home(h, keys[i + PREFETCH_AHEAD], 0)]);
            PREFETCH(&p->slots[home(p, keys[i + PREFETCH_AHEAD], tag)]);
        }
        const Slot *s = &h->slots[find(HOLDERS, h, keys[i], 0)];
        int predicted = occupied(PREDICTED, &p->slots[find(PREDICTED, p, keys[i], tag)]);
        if (occupied(HOLDERS, s) && mask_has(s->v.holders, replica) && !predicted)
            continue; /* really held */
        count++;
        holder_inserts += !occupied(HOLDERS, s);
        prediction_inserts += !predicted;
    }
    tracked = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint64_t));
    if (tracked == NULL || reserve(HOLDERS, h, holder_inserts) < 0 || reserve(PREDICTED, p, prediction_inserts) < 0)
        goto done;
    /* From here on nothing can fail: every key predicted is in `tracked`. */
    char *out = PyBytes_AS_STRING(tracked);
    Py_ssize_t fresh = 0, written = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = keys[i];
        size_t j = find(HOLDERS, h, key, 0);
        Slot *s = &h->slots[j];
        size_t at = find(PREDICTED, p, key, tag);
        if (occupied(HOLDERS, s) && mask_has(s->v.holders, replica)) {
            if (!occupied(PREDICTED, &p->slots[at]))
                continue; /* really held */
            p->slots[at].v.predicted.until = until;
        }
        else {
            if (!occupied(HOLDERS, s))
                s = insert_at(h, j, key);
            mask_set(&s->v.holders, replica);
            Slot *q = insert_at(p, at, key);
            q->v.predicted.replica1 = tag;
            q->v.predicted.until = until;
            fresh++;
        }
        memcpy(out + (size_t)written++ * sizeof(uint64_t), &key, sizeof(uint64_t));
    }
    result = Py_BuildValue("(nO)", fresh, tracked);
done:
    Py_XDECREF(tracked);
    PyMem_Free(keys);
    return result;
}

PyDoc_STRVAR(expire_doc,
             "expire(tracked, replica, now, /)\n--\n\n"
             "Retire replica slot ``replica``'s predictions of the keys in ``tracked``\n"
             "(``predict``'s bytes) whose ``until`` is at or before ``now`` (not NaN); confirmed,\n"
             "cleared or extended ones are skipped.  A retired key loses the replica's bit.\n"
             "Returns how many were retired.");

static PyObject *
BlockTable_expire(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *keys;
    Py_ssize_t n;
    uint32_t replica;
    double now;
    if (event_args("expire", args, nargs, 3, &keys, &n, &replica, &now) < 0)
        return NULL;
    Table *h = &t->holders, *p = &t->predicted;
    uint64_t tag = (uint64_t)replica + 1;
    Py_ssize_t expired = 0;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        PREFETCH(&p->slots[home(p, keys[i], tag)]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            PREFETCH(&p->slots[home(p, keys[i + PREFETCH_AHEAD], tag)]);
            PREFETCH(&h->slots[home(h, keys[i + PREFETCH_AHEAD], 0)]);
        }
        size_t at = find(PREDICTED, p, keys[i], tag);
        if (!occupied(PREDICTED, &p->slots[at]) || p->slots[at].v.predicted.until > now)
            continue;
        erase(PREDICTED, p, at); /* occupied, checked above, and nothing ran since */
        drop_holder(h, keys[i], replica);
        expired++;
    }
    PyMem_Free(keys);
    shrink(PREDICTED, p);
    shrink(HOLDERS, h);
    return PyLong_FromSsize_t(expired);
}

/* Append key to a growing array; -1 with MemoryError. */
static int
push_key(uint64_t **keys, size_t *count, size_t *cap, uint64_t key)
{
    if (*count == *cap) {
        size_t grown_cap = *cap ? *cap * 2 : 1024;
        uint64_t *grown = PyMem_Realloc(*keys, grown_cap * sizeof(uint64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *keys = grown;
        *cap = grown_cap;
    }
    (*keys)[(*count)++] = key;
    return 0;
}

PyDoc_STRVAR(clear_replica_doc,
             "clear_replica(replica, /)\n--\n\n"
             "Forget every block of replica slot ``replica``, real and predicted (a replica\n"
             "cleared or gone).  Keys left without a holder go; tables left at most 1/8 full\n"
             "shrink.  One pass over each table: for rare events.  Returns how many keys it\n"
             "really held (predictions not counted).");

static PyObject *
BlockTable_clear_replica(BlockTable *t, PyObject *arg)
{
    uint32_t replica;
    if (replica_of(arg, &replica) < 0)
        return NULL;
    Table *h = &t->holders, *p = &t->predicted;
    uint64_t tag = (uint64_t)replica + 1;
    uint64_t *held = NULL, *guessed = NULL;
    size_t n_held = 0, cap_held = 0, n_guessed = 0, cap_guessed = 0;
    PyObject *result = NULL;
    /* Collect first, change after: erasing shifts slots, and an allocation failure must change nothing. */
    for (size_t j = 0; j <= p->capacity_mask; j++) {
        if (p->slots[j].v.predicted.replica1 == tag && push_key(&guessed, &n_guessed, &cap_guessed, p->slots[j].key) < 0)
            goto done;
    }
    for (size_t j = 0; j <= h->capacity_mask; j++) {
        if (occupied(HOLDERS, &h->slots[j]) && mask_has(h->slots[j].v.holders, replica)
            && push_key(&held, &n_held, &cap_held, h->slots[j].key) < 0)
            goto done;
    }
    for (size_t i = 0; i < n_guessed; i++)
        erase(PREDICTED, p, find(PREDICTED, p, guessed[i], tag));
    for (size_t i = 0; i < n_held; i++)
        drop_holder(h, held[i], replica);
    shrink(PREDICTED, p);
    shrink(HOLDERS, h);
    result = PyLong_FromSize_t(n_held - n_guessed);
done:
    PyMem_Free(held);
    PyMem_Free(guessed);
    return result;
}

PyDoc_STRVAR(clear_replica_part_doc,
             "clear_replica_part(replica, start, max_slots, /)\n--\n\n"
             "One resumable step of ``clear_replica(replica)``: drop replica slot ``replica``'s\n"
             "predictions and bits (keys left without a holder go) from at most ``max_slots``\n"
             "(>= 1) slots, the PREDICTED table's then the HOLDERS table's, in slot order.\n"
             "``start`` 0 begins a clear (abandoning any other one of this table); any other\n"
             "``start`` must be the ``next_start`` this table's last call returned for the same\n"
             "replica (else ValueError).  Other replicas' adds, removes, predictions, expiries\n"
             "and the rehashes they cause may run between two calls (a rehash starts the\n"
             "table's scan over); nothing may give ``replica`` a key until the clear is done.\n"
             "Once done, tables left at most 1/8 full shrink.\n\n"
             "Returns ``(next_start, real_dropped, done)``: ``next_start`` an opaque int (0 once\n"
             "done), ``real_dropped`` the keys this step took from the replica that it really\n"
             "held (predictions not counted), ``done`` True once no entry of the replica is left.");

static PyObject *
BlockTable_clear_replica_part(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t replica;
    unsigned long long start, max_slots;
    if (!check_nargs("clear_replica_part", nargs, 3, 3) || replica_of(args[0], &replica) < 0
        || bounded_int(args[1], "start", ULLONG_MAX, &start) < 0
        || bounded_int(args[2], "max_slots", PY_SSIZE_T_MAX, &max_slots) < 0)
        return NULL;
    if (max_slots == 0) {
        PyErr_SetString(PyExc_ValueError, "max_slots must be at least 1");
        return NULL;
    }
    if (start != 0 && !(t->scanning && t->scan_replica == replica && t->scan_token == start)) {
        PyErr_Format(PyExc_ValueError,
                     "start must be 0 (a new clear) or the next_start this table last returned for replica %u",
                     (unsigned)replica);
        return NULL;
    }
    Table *h = &t->holders, *p = &t->predicted;
    uint64_t tag = (uint64_t)replica + 1;
    if (start == 0) { /* a new clear: the predictions first, so that every bit left after them is real */
        t->scanning = 1;
        t->scan_replica = replica;
        t->scan_phase = 0;
        p->scan_at = 0;
        h->scan_at = SIZE_MAX;
    }
    size_t budget = (size_t)max_slots;
    Py_ssize_t dropped = 0;
    if (t->scan_phase == 0) {
        size_t i = p->scan_at;
        p->scan_at = SIZE_MAX; /* this loop looks at slot i again after each erase: no tracking */
        while (budget > 0 && i <= p->capacity_mask) {
            budget--;
            const Slot *s = &p->slots[i];
            if (s->v.predicted.replica1 != tag) {
                i++;
                continue;
            }
            uint64_t key = s->key;
            erase(PREDICTED, p, i); /* a later entry of the run may have moved into slot i */
            drop_holder(h, key, replica);
        }
        if (i <= p->capacity_mask)
            p->scan_at = i;
        else {
            t->scan_phase = 1;
            h->scan_at = 0;
        }
    }
    int done = 0;
    if (t->scan_phase == 1 && budget > 0) {
        size_t i = h->scan_at;
        h->scan_at = SIZE_MAX;
        while (budget > 0 && i <= h->capacity_mask) {
            budget--;
            Slot *s = &h->slots[i];
            if (occupied(HOLDERS, s) && mask_has(s->v.holders, replica)) {
                dropped++; /* real: the replica has no prediction left */
                mask_clear(&s->v.holders, replica);
                if (!mask_any(s->v.holders)) {
                    erase(HOLDERS, h, i); /* look at slot i again */
                    continue;
                }
            }
            i++;
        }
        if (i <= h->capacity_mask)
            h->scan_at = i;
        else
            done = 1;
    }
    if (done) { /* both cursors are SIZE_MAX already: shrinking restarts no scan */
        t->scanning = 0;
        t->scan_token = 0;
        shrink(PREDICTED, p);
        shrink(HOLDERS, h);
    }
    else {
        size_t at = t->scan_phase ? h->scan_at : p->scan_at;
        t->scan_token = (((unsigned long long)at << 1) | (unsigned long long)t->scan_phase) + 1; /* never 0 */
    }
    return Py_BuildValue("(KnN)", t->scan_token, dropped, PyBool_FromLong(done));
}

PyDoc_STRVAR(replica_entries_doc,
             "replica_entries(replica, /)\n--\n\n"
             "``(keys, predictions)``: how many keys have replica slot ``replica``'s bit (really\n"
             "or by prediction) and how many of its predictions are pending.  One pass over\n"
             "both tables: for tests and debugging.");

static PyObject *
BlockTable_replica_entries(BlockTable *t, PyObject *arg)
{
    uint32_t replica;
    if (replica_of(arg, &replica) < 0)
        return NULL;
    size_t keys = 0, predictions = 0;
    for (size_t j = 0; j <= t->holders.capacity_mask; j++) {
        const Slot *s = &t->holders.slots[j];
        keys += occupied(HOLDERS, s) && mask_has(s->v.holders, replica);
    }
    for (size_t j = 0; j <= t->predicted.capacity_mask; j++)
        predictions += t->predicted.slots[j].v.predicted.replica1 == (uint64_t)replica + 1;
    return Py_BuildValue("(nn)", (Py_ssize_t)keys, (Py_ssize_t)predictions);
}

static PyMethodDef BlockTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockTable_get, METH_FASTCALL, get_doc},
    {"until", (PyCFunction)(void (*)(void))BlockTable_until, METH_FASTCALL, until_doc},
    {"memory_bytes", (PyCFunction)BlockTable_memory_bytes, METH_NOARGS, memory_bytes_doc},
    {"walk", (PyCFunction)(void (*)(void))BlockTable_walk, METH_FASTCALL, walk_doc},
    {"walk_tiers", (PyCFunction)(void (*)(void))BlockTable_walk_tiers, METH_FASTCALL, walk_tiers_doc},
    {"add", (PyCFunction)(void (*)(void))BlockTable_add, METH_FASTCALL, add_doc},
    {"remove", (PyCFunction)(void (*)(void))BlockTable_remove, METH_FASTCALL, remove_doc},
    {"predict", (PyCFunction)(void (*)(void))BlockTable_predict, METH_FASTCALL, predict_doc},
    {"expire", (PyCFunction)(void (*)(void))BlockTable_expire, METH_FASTCALL, expire_doc},
    {"clear_replica", (PyCFunction)BlockTable_clear_replica, METH_O, clear_replica_doc},
    {"clear_replica_part", (PyCFunction)(void (*)(void))BlockTable_clear_replica_part, METH_FASTCALL,
     clear_replica_part_doc},
    {"replica_entries", (PyCFunction)BlockTable_replica_entries, METH_O, replica_entries_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BlockTable_getset[] = {
    {"num_predictions", (getter)BlockTable_get_num_predictions, NULL,
     "(key, replica) predictions pending (an int)", NULL},
    {"capacity", (getter)BlockTable_get_capacity, NULL, "slots of the holders table (an int)", NULL},
    {"prediction_capacity", (getter)BlockTable_get_prediction_capacity, NULL,
     "slots of the predictions table (an int)", NULL},
    {"rehashes", (getter)BlockTable_get_rehashes, NULL,
     "times either table changed capacity, grown or shrunk (an int; a partial clear's scan of that table "
     "starts over)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods BlockTable_as_mapping = {
    .mp_length = (lenfunc)BlockTable_len,
};

static PySequenceMethods BlockTable_as_sequence = {
    .sq_contains = (objobjproc)BlockTable_contains,
};

PyDoc_STRVAR(BlockTable_doc,
             "BlockTable(seed=0)\n--\n\n"
             "The block index's tables: block key (an int in [0, 2**64)) -> the replicas\n"
             "holding it (slots 0 to MAX_REPLICAS - 1), and (key, replica) -> the expiry of\n"
             "the replica's prediction.  ``len()`` is the number of keys some replica\n"
             "holds; ``key in table`` tests one.  ``seed`` (64-bit) scatters keys over\n"
             "slots; pass a random one.  Bad keys raise TypeError / OverflowError.");

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
    .tp_getset = BlockTable_getset,
    .tp_new = BlockTable_new,
};

static struct PyModuleDef blocktable_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "routing._blocktable",
    .m_doc = "The block index's hash tables (see routing.index).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__blocktable(void)
{
    if (SIXTY_FOUR == NULL && (SIXTY_FOUR = PyLong_FromLong(64)) == NULL)
        return NULL;
    if (PyType_Ready(&BlockTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&blocktable_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_REPLICAS", MAX_REPLICAS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&BlockTableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(&BlockTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
