/*
 * routing._contenders: the routing policy's score of every candidate in one C pass, and
 * which candidates can win (routing/contenders.py is the Python face and says why).
 *
 * score(...) mirrors routing.policy.choose_replica's arithmetic, in the same order of
 * operations, over columns (one entry per candidate):
 *
 *   g    = min(matched * bs, usable)
 *   c    = host > 0 ? min((matched + host) * bs, usable) : g
 *   cost = (prompt - g + queued) * p + (isnan(running) ? inflight : running) * running_s
 *          [- (c - g) * p, + (c - g) * host_price when priced and c > g]
 *          + waiting * waiting_s (when waiting) + kv_penalty (when kv_usage >= threshold)
 *   score = cost + (prompt - c) * extra  [+ eviction term]
 *
 * and marks in keep[] every candidate within a margin of its load class's lowest score
 * (within the load bound, over it, saturated), the two with the most cached tokens, and
 * the one with the most among those within the bound and among those not saturated.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#define MARGIN 1e-9

typedef struct {
    Py_buffer view;
    int held;
} Col;

/* A contiguous column of n items of the given size (8) and kind ('q' int64 / 'd' float64, or 'B' bool out). */
static int
column(PyObject *obj, Col *col, Py_ssize_t n, char kind, int writable, const char *name)
{
    col->held = 0;
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &col->view, flags) < 0)
        return -1;
    col->held = 1;
    const char *f = col->view.format ? col->view.format : "B";
    if (*f == '=' || *f == '<' || *f == '@')
        f++;
    Py_ssize_t size = kind == 'B' ? 1 : 8;
    int ok = col->view.itemsize == size && col->view.len == n * size &&
             (kind == 'd' ? strcmp(f, "d") == 0
              : kind == 'q' ? (strcmp(f, "q") == 0 || strcmp(f, "l") == 0)
                            : (strcmp(f, "?") == 0 || strcmp(f, "B") == 0));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be %zd contiguous %s, got format %s and %zd bytes", name, n,
                     kind == 'd' ? "float64" : kind == 'q' ? "int64" : "bools", f, col->view.len);
        return -1;
    }
    return 0;
}

static void
release(Col *cols, int k)
{
    for (int i = 0; i < k; i++)
        if (cols[i].held)
            PyBuffer_Release(&cols[i].view);
}

PyDoc_STRVAR(score_doc,
             "score(prompt, block_size, params, matched, host, inflight, queued, running, waiting,\n"
             "      kv_usage, max_ongoing, free_blocks, host_price, keep, /)\n--\n\n"
             "Score every candidate as routing.policy.choose_replica does and set keep[i] for the\n"
             "candidates that can win (see routing/contenders.py).  ``params``: a tuple of the\n"
             "policy's (prefill_cost_per_token_s, running_penalty_s, waiting_penalty_s,\n"
             "kv_pressure_threshold, kv_pressure_penalty_s, load_epsilon, load_floor, uncached_weight,\n"
             "busy_cluster_weight, eviction_weight, price_tiers).  Columns: int64 matched, host,\n"
             "inflight, queued; float64 the others; keep: a zeroed bool array (written).\n\n"
             "Returns ``(total_inflight, least_queued, least_queued_free or None, fits_somewhere)``.");

static PyObject *
score(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "score takes 14 arguments, got %zd", nargs);
        return NULL;
    }
    long long prompt = PyLong_AsLongLong(args[0]), bs = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    double p, rs, ws, thr, kvpen, eps, floor_, uw, bw, ew;
    int price;
    if (!PyArg_ParseTuple(args[2], "ddddddddddp", &p, &rs, &ws, &thr, &kvpen, &eps, &floor_, &uw, &bw, &ew,
                          &price))
        return NULL;
    Py_ssize_t n = PyObject_Length(args[3]);
    if (n < 0)
        return NULL;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "score needs at least one candidate");
        return NULL;
    }
    static const char kinds[] = "qqqqddddddB";
    static const char *names[] = {"matched", "host", "inflight", "queued", "running", "waiting", "kv_usage",
                                  "max_ongoing", "free_blocks", "host_price", "keep"};
    Col cols[11];
    for (int k = 0; k < 11; k++) {
        if (column(args[3 + k], &cols[k], n, kinds[k], k == 10, names[k]) < 0) {
            release(cols, k + 1);
            return NULL;
        }
    }
    const int64_t *matched = cols[0].view.buf, *host = cols[1].view.buf, *inflight = cols[2].view.buf,
                  *queued = cols[3].view.buf;
    const double *running = cols[4].view.buf, *waiting = cols[5].view.buf, *kv = cols[6].view.buf,
                 *max_ongoing = cols[7].view.buf, *free_blocks = cols[8].view.buf, *host_price = cols[9].view.buf;
    uint8_t *keep = cols[10].view.buf;
    double *scores = PyMem_Malloc(sizeof(double) * (size_t)n);
    int64_t *cached = PyMem_Malloc(sizeof(int64_t) * (size_t)n);
    PyObject *result = NULL;
    if (scores == NULL || cached == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    long long usable = (prompt > 0 ? (prompt - 1) / bs : 0) * bs;
    long long total = 0, least_queued = 0, least_queued_free = 0;
    int any_free = 0, fits = 0;
    /* Pass 1: the unweighted cost (into scores), cached tokens, the aggregates. */
    for (Py_ssize_t i = 0; i < n; i++) {
        long long g = matched[i] * bs;
        if (g > usable)
            g = usable;
        long long c = g;
        double run = isnan(running[i]) ? (double)inflight[i] : running[i];
        double cost = (double)(prompt - c + queued[i]) * p + run * rs;
        if (host[i]) {
            c = (matched[i] + host[i]) * bs;
            if (c > usable)
                c = usable;
            if (c > g) {
                cost -= (double)(c - g) * p;
                if (price && host_price[i] != 0.0)
                    cost += (double)(c - g) * host_price[i];
            }
        }
        if (waiting[i] != 0.0)
            cost += waiting[i] * ws;
        if (!isnan(kv[i]) && kv[i] >= thr)
            cost += kvpen;
        scores[i] = cost;
        cached[i] = c;
        total += inflight[i];
        if (i == 0 || queued[i] < least_queued)
            least_queued = queued[i];
        if ((double)inflight[i] < max_ongoing[i]) {
            if (!any_free || queued[i] < least_queued_free)
                least_queued_free = queued[i];
            any_free = 1;
        }
        if (!isnan(free_blocks[i]) && (double)((prompt - g) / bs) <= fmax(free_blocks[i], 0.0))
            fits = 1;
    }
    double weight = uw;
    if (bw != 0.0 && prompt > 0)
        weight *= 1.0 + bw * (double)(any_free ? least_queued_free : least_queued) / (double)prompt;
    double extra = (weight - 1.0) * p, per_evicted = ew * p * (double)bs;
    double bound = fmax(ceil((1.0 + eps) * (double)(total + 1) / (double)n), floor_);
    double lowest[3] = {INFINITY, INFINITY, INFINITY};
    Py_ssize_t top1 = -1, top2 = -1, best_within = -1, best_free = -1;
    /* Pass 2: the ranking score, each class's lowest, the most cached. */
    for (Py_ssize_t i = 0; i < n; i++) {
        double s = scores[i] + (double)(prompt - cached[i]) * extra;
        if (per_evicted != 0.0 && fits && !isnan(free_blocks[i])) {
            long long g = matched[i] * bs;
            if (g > usable)
                g = usable;
            double evicted = (double)((prompt - g) / bs) - fmax(free_blocks[i], 0.0);
            if (evicted > 0)
                s += evicted * (price && host_price[i] != 0.0 ? ew * host_price[i] * (double)bs : per_evicted);
        }
        scores[i] = s;
        int is_free = (double)inflight[i] < max_ongoing[i];
        int cls = !is_free ? 2 : (double)inflight[i] < bound ? 0 : 1;
        if (s < lowest[cls])
            lowest[cls] = s;
        if (top1 < 0 || cached[i] > cached[top1]) {
            top2 = top1;
            top1 = i;
        } else if (top2 < 0 || cached[i] > cached[top2]) {
            top2 = i;
        }
        if (cls == 0 && (best_within < 0 || cached[i] > cached[best_within]))
            best_within = i;
        if (is_free && (best_free < 0 || cached[i] > cached[best_free]))
            best_free = i;
    }
    /* Pass 3: keep each class's lowest and all within the margin of it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int is_free = (double)inflight[i] < max_ongoing[i];
        int cls = !is_free ? 2 : (double)inflight[i] < bound ? 0 : 1;
        if (scores[i] <= lowest[cls] + MARGIN * fmax(1.0, fabs(lowest[cls])))
            keep[i] = 1;
    }
    Py_ssize_t marks[4] = {top1, top2, best_within, best_free};
    for (int k = 0; k < 4; k++)
        if (marks[k] >= 0)
            keep[marks[k]] = 1;
    if (any_free)
        result = Py_BuildValue("(LLLO)", total, least_queued, least_queued_free, fits ? Py_True : Py_False);
    else
        result = Py_BuildValue("(LLOO)", total, least_queued, Py_None, fits ? Py_True : Py_False);
done:
    PyMem_Free(scores);
    PyMem_Free(cached);
    release(cols, 11);
    return result;
}

static PyMethodDef methods[] = {
    {"score", (PyCFunction)(void (*)(void))score, METH_FASTCALL, score_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "routing._contenders",
    "The routing policy's score of every candidate in one C pass (see routing/contenders.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__contenders(void)
{
    return PyModule_Create(&module);
}
