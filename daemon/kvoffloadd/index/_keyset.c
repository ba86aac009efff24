/* A set of equal-length byte keys without a Python object per key: the index's ready
 * keys (keyset.py). A lookup of a packed key field answers how many leading keys are in
 * the set in one call, with no key object made.
 *
 * Layout: open addressing with linear probing, a table of entries of [4-byte tag][key
 * bytes] (rounded up to 4 bytes); tag 0 marks an empty entry. The tag is the low 32
 * bits of the key's SipHash-1-3 under a 128-bit secret the caller passes (os.urandom):
 * keys come from engines, and without the secret nobody can choose keys that collide.
 * The home entry of a key is (tag * capacity) >> 32, so the table is rebuilt from the
 * tags alone when it is resized, and a removal shifts the entries after it back (no
 * tombstones: probes stay short however many keys come and go). Past 4/5 full, or
 * below 1/5, the table is rebuilt 11/20 full: as keys are added it holds each in
 * 1.25-1.8 entries whatever their number (a power-of-two table doubled at 3/4 holds it
 * in 1.33-2.67), after removals in at most 5. Its memory comes from PyMem_Raw (traced
 * by tracemalloc, as the index's memory is measured).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MIN_CAPACITY 16
#define MAX_KEY_BYTES 64

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

/* ---------------------------------------------------------------- SipHash-1-3 */

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                         \
    do {                                                                                 \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                          \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                           \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                           \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                          \
    } while (0)

static inline uint64_t load_le64(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static uint64_t siphash13(uint64_t k0, uint64_t k1, const uint8_t *in, size_t len) {
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    const uint8_t *end = in + (len & ~(size_t)7);
    for (; in != end; in += 8) {
        uint64_t m = load_le64(in);
        v3 ^= m;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t b = ((uint64_t)len) << 56;
    switch (len & 7) { /* the last 1-7 bytes, without a loop */
    case 7: b |= ((uint64_t)in[6]) << 48; /* fall through */
    case 6: b |= ((uint64_t)in[5]) << 40; /* fall through */
    case 5: b |= ((uint64_t)in[4]) << 32; /* fall through */
    case 4: b |= ((uint64_t)in[3]) << 24; /* fall through */
    case 3: b |= ((uint64_t)in[2]) << 16; /* fall through */
    case 2: b |= ((uint64_t)in[1]) << 8;  /* fall through */
    case 1: b |= ((uint64_t)in[0]);       /* fall through */
    case 0: break;
    }
    v3 ^= b;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* ---------------------------------------------------------------- the table */

typedef struct {
    PyObject_HEAD
    uint64_t k0, k1;
    Py_ssize_t key_bytes; /* 0 until the first key */
    size_t stride;        /* bytes per entry: 4 + key_bytes, rounded up to 4 */
    size_t cap;           /* entries (0: no table yet) */
    size_t count;
    uint8_t *table;
} KeySet;

/* A key's tag: the low 32 bits of its SipHash-1-3 under the set's secret, never 0. */
static inline uint32_t tag_of_len(const KeySet *s, const uint8_t *key, size_t len) {
    uint32_t t = (uint32_t)siphash13(s->k0, s->k1, key, len);
    return t ? t : 1;
}

static inline uint32_t tag_of(const KeySet *s, const uint8_t *key) {
    return tag_of_len(s, key, (size_t)s->key_bytes);
}

/* Whether two keys of ``n`` bytes are equal: a word at a time, inline (keys are short:
 * a call to memcmp costs more than the comparison). */
static inline int same_key(const uint8_t *a, const uint8_t *b, size_t n) {
    uint64_t x, y;
    for (; n >= 8; a += 8, b += 8, n -= 8) {
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        if (x != y)
            return 0;
    }
    for (; n; a++, b++, n--)
        if (*a != *b)
            return 0;
    return 1;
}

static inline uint32_t entry_tag(const uint8_t *e) {
    uint32_t t;
    memcpy(&t, e, 4);
    return t;
}

static inline size_t home(uint32_t tag, size_t cap) {
    return (size_t)(((uint64_t)tag * cap) >> 32);
}

/* The capacity that holds ``count`` keys 11/20 full. */
static inline size_t sized_for(size_t count) {
    size_t cap = count * 20 / 11 + 1;
    return cap < MIN_CAPACITY ? MIN_CAPACITY : cap;
}

/* The entry holding ``key`` (*found = 1) or the empty entry where it would go. */
static size_t find(const KeySet *s, const uint8_t *key, uint32_t tag, int *found) {
    size_t i = home(tag, s->cap);
    for (;;) {
        const uint8_t *e = s->table + i * s->stride;
        uint32_t t = entry_tag(e);
        if (t == 0) {
            *found = 0;
            return i;
        }
        if (t == tag && same_key(e + 4, key, (size_t)s->key_bytes)) {
            *found = 1;
            return i;
        }
        if (++i == s->cap)
            i = 0;
    }
}

static int rebuild(KeySet *s, size_t cap) {
    uint8_t *table = PyMem_RawCalloc(cap, s->stride);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t j = 0; j < s->cap; j++) {
        const uint8_t *e = s->table + j * s->stride;
        uint32_t t = entry_tag(e);
        if (t == 0)
            continue;
        size_t i = home(t, cap);
        while (entry_tag(table + i * s->stride) != 0)
            if (++i == cap)
                i = 0;
        memcpy(table + i * s->stride, e, s->stride);
    }
    PyMem_RawFree(s->table);
    s->table = table;
    s->cap = cap;
    return 0;
}

/* A key of this set's length, or -1 with an exception set. */
static int check_key(KeySet *s, PyObject *key, const uint8_t **data) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys are bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    if (s->key_bytes == 0) {
        if (n < 1 || n > MAX_KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "keys are 1..%d bytes, not %zd", MAX_KEY_BYTES, n);
            return -1;
        }
        s->key_bytes = n;
        s->stride = (4 + (size_t)n + 3) & ~(size_t)3;
    } else if (n != s->key_bytes) {
        PyErr_Format(PyExc_ValueError, "this set holds keys of %zd bytes, not %zd",
                     s->key_bytes, n);
        return -1;
    }
    *data = (const uint8_t *)PyBytes_AS_STRING(key);
    return 0;
}

static int add_one(KeySet *s, PyObject *key) {
    const uint8_t *data;
    int first = s->key_bytes == 0, found = 0;
    if (check_key(s, key, &data) < 0)
        return -1;
    uint32_t tag = tag_of(s, data);
    size_t i = s->cap ? find(s, data, tag, &found) : 0;
    if (found)
        return 0;
    if ((s->count + 1) * 5 > s->cap * 4) {
        if (rebuild(s, sized_for(s->count + 1)) < 0) {
            if (first)
                s->key_bytes = 0; /* nothing was added: the first key's length is not fixed */
            return -1;
        }
        i = find(s, data, tag, &found);
    }
    uint8_t *e = s->table + i * s->stride;
    memcpy(e, &tag, 4);
    memcpy(e + 4, data, (size_t)s->key_bytes);
    s->count++;
    return 0;
}

/* Whether ``key`` (``n`` bytes at ``data``) is in the set. */
static inline int has(const KeySet *s, const uint8_t *data, Py_ssize_t n) {
    if (n != s->key_bytes || s->count == 0)
        return 0;
    int found;
    find(s, data, tag_of(s, data), &found);
    return found;
}

/* How many entries on from ``from`` ``to`` is, going round the table. */
static inline size_t ahead(size_t from, size_t to, size_t cap) {
    return to >= from ? to - from : to + cap - from;
}

static void erase_at(KeySet *s, size_t i) {
    size_t cap = s->cap, j = i;
    for (;;) {
        if (++j == cap)
            j = 0;
        uint8_t *e = s->table + j * s->stride;
        uint32_t t = entry_tag(e);
        if (t == 0)
            break;
        /* the entry at j moves back to i unless its home lies cyclically in (i, j] */
        if (ahead(home(t, cap), j, cap) >= ahead(i, j, cap)) {
            memcpy(s->table + i * s->stride, e, s->stride);
            i = j;
        }
    }
    memset(s->table + i * s->stride, 0, 4);
    s->count--;
}

/* ---------------------------------------------------------------- Python methods */

static PyObject *KeySet_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_buffer secret;
    static char *names[] = {"secret", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*:KeySet", names, &secret))
        return NULL;
    if (secret.len != 16) {
        PyBuffer_Release(&secret);
        PyErr_SetString(PyExc_ValueError, "the secret is 16 bytes");
        return NULL;
    }
    KeySet *s = (KeySet *)type->tp_alloc(type, 0);
    if (s != NULL) {
        s->k0 = load_le64((const uint8_t *)secret.buf);
        s->k1 = load_le64((const uint8_t *)secret.buf + 8);
    }
    PyBuffer_Release(&secret);
    return (PyObject *)s;
}

static void KeySet_dealloc(KeySet *s) {
    PyMem_RawFree(s->table);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static Py_ssize_t KeySet_len(KeySet *s) { return (Py_ssize_t)s->count; }

static int KeySet_contains(KeySet *s, PyObject *key) {
    if (!PyBytes_Check(key))
        return 0;
    return has(s, (const uint8_t *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
}

static PyObject *KeySet_add(KeySet *s, PyObject *key) {
    if (add_one(s, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeySet_update(KeySet *s, PyObject *keys) {
    PyObject *it = PyObject_GetIter(keys);
    if (it == NULL)
        return NULL;
    PyObject *key;
    while ((key = PyIter_Next(it)) != NULL) {
        int rc = add_one(s, key);
        Py_DECREF(key);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeySet_discard(KeySet *s, PyObject *key) {
    if (PyBytes_Check(key) && s->count && PyBytes_GET_SIZE(key) == s->key_bytes) {
        const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(key);
        int found;
        size_t i = find(s, data, tag_of(s, data), &found);
        if (found) {
            erase_at(s, i);
            if (s->cap > MIN_CAPACITY && s->count * 5 < s->cap &&
                rebuild(s, sized_for(s->count)) < 0)
                PyErr_Clear(); /* no room to shrink: the larger table stays, as valid */
        }
    }
    Py_RETURN_NONE;
}

static PyObject *KeySet_prefix(KeySet *s, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "prefix() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), hits = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; hits < n; hits++) {
        PyObject *key = items[hits];
        if (!PyBytes_Check(key) ||
            !has(s, (const uint8_t *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)))
            break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(hits);
}

/* How many of the ``n`` packed keys at ``p`` lead in the set. The keys AHEAD places
 * on are hashed and their home entries fetched into the cache while this one is
 * compared: in a table larger than the caches each probe would otherwise wait for
 * memory in turn. */
#define AHEAD 8
static Py_ssize_t leading(const KeySet *s, const uint8_t *p, Py_ssize_t n, Py_ssize_t kb) {
    if (kb != s->key_bytes || s->count == 0)
        return 0;
    uint32_t tags[AHEAD];
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) {
        tags[i] = tag_of(s, p + i * kb);
        PREFETCH(s->table + home(tags[i], s->cap) * s->stride);
    }
    Py_ssize_t hits = 0;
    for (; hits < n; hits++) {
        uint32_t tag = tags[hits % AHEAD];
        Py_ssize_t next = hits + AHEAD;
        if (next < n) {
            uint32_t t = tag_of(s, p + next * kb);
            tags[next % AHEAD] = t;
            PREFETCH(s->table + home(t, s->cap) * s->stride);
        }
        int found;
        find(s, p + hits * kb, tag, &found);
        if (!found)
            break;
    }
    return hits;
}

static PyObject *KeySet_prefix_packed(KeySet *s, PyObject *args) {
    Py_buffer packed;
    Py_ssize_t key_bytes;
    if (!PyArg_ParseTuple(args, "y*n:prefix_packed", &packed, &key_bytes))
        return NULL;
    if (packed.len && (key_bytes < 1 || packed.len % key_bytes)) {
        PyBuffer_Release(&packed);
        PyErr_Format(PyExc_ValueError,
                     "packed keys of %zd bytes do not split into keys of %zd bytes",
                     packed.len, key_bytes);
        return NULL;
    }
    Py_ssize_t n = packed.len ? packed.len / key_bytes : 0;
    Py_ssize_t hits = leading(s, (const uint8_t *)packed.buf, n, key_bytes);
    PyBuffer_Release(&packed);
    return PyLong_FromSsize_t(hits);
}

static PyObject *KeySet_iter(KeySet *s) {
    PyObject *list = PyList_New((Py_ssize_t)s->count);
    if (list == NULL)
        return NULL;
    Py_ssize_t k = 0;
    for (size_t j = 0; j < s->cap && k < (Py_ssize_t)s->count; j++) {
        const uint8_t *e = s->table + j * s->stride;
        if (entry_tag(e) == 0)
            continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)e + 4, s->key_bytes);
        if (key == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k++, key);
    }
    PyObject *it = PyObject_GetIter(list);
    Py_DECREF(list);
    return it;
}

static PyObject *KeySet_table_bytes(KeySet *s, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(s->cap * s->stride);
}

static PyObject *KeySet_tag(KeySet *s, PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "keys are bytes");
        return NULL;
    }
    return PyLong_FromUnsignedLong(tag_of_len(s, (const uint8_t *)PyBytes_AS_STRING(key),
                                              (size_t)PyBytes_GET_SIZE(key)));
}

static PyMethodDef KeySet_methods[] = {
    {"add", (PyCFunction)KeySet_add, METH_O, "Add a key (bytes of the set's length)."},
    {"update", (PyCFunction)KeySet_update, METH_O, "Add every key of an iterable."},
    {"discard", (PyCFunction)KeySet_discard, METH_O, "Remove a key if it is there."},
    {"prefix", (PyCFunction)KeySet_prefix, METH_O,
     "How many leading keys of a sequence are in the set."},
    {"prefix_packed", (PyCFunction)KeySet_prefix_packed, METH_VARARGS,
     "How many leading keys of a packed key field are in the set."},
    {"table_bytes", (PyCFunction)KeySet_table_bytes, METH_NOARGS,
     "Bytes of the table (for tests and statistics)."},
    {"_tag", (PyCFunction)KeySet_tag, METH_O,
     "A key's tag: the low 32 bits of its SipHash-1-3 under the secret, 0 made 1 (tests)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeySet_as_sequence = {
    .sq_length = (lenfunc)KeySet_len,
    .sq_contains = (objobjproc)KeySet_contains,
};

static PyTypeObject KeySetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffloadd.index._keyset.KeySet",
    .tp_basicsize = sizeof(KeySet),
    .tp_dealloc = (destructor)KeySet_dealloc,
    .tp_as_sequence = &KeySet_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A set of equal-length byte keys, keyed-hashed, no object per key.",
    .tp_iter = (getiterfunc)KeySet_iter,
    .tp_methods = KeySet_methods,
    .tp_new = KeySet_new,
};

static struct PyModuleDef keyset_module = {
    PyModuleDef_HEAD_INIT, "_keyset", "The index's ready keys in C (keyset.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__keyset(void) {
    if (PyType_Ready(&KeySetType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&keyset_module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&KeySetType);
    if (PyModule_AddObject(mod, "KeySet", (PyObject *)&KeySetType) < 0) {
        Py_DECREF(&KeySetType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
