/* The region's slot records, written a batch per call (journal.py): a store's records
 * with no bytes object, struct pack or mapping slice per record.
 *
 * A record is SLOT_DTYPE of kvoffload.datapath.regionfmt (96 bytes: state, key_len,
 * pad, ns, seq, key[64], lease, crc, reserved; little-endian); this module exports the
 * offsets it writes and journal.py checks them against the dtype at import. A slot's
 * record lies at table_offset + (extent * spe_max + slot % spe) * 96, where extent is
 * extents[slot // spe] (None: a hole, a broken invariant: AssertionError).
 *
 * Every call checks all its slots and keys first and writes nothing when one is wrong
 * (a slot outside the namespace or the mapping, a key longer than 64 bytes). A READY
 * record's sequence number and CRC are stored before its state byte (a release store):
 * a daemon killed part way leaves each record either still in flight or whole, as
 * recovery.py expects. The CRC is zlib's CRC-32 of (ns u32, seq u64, key_len u8) and
 * the key (regionfmt.ready_crc).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define RECORD_BYTES 96
#define KEY_BYTES_MAX 64
#define OFF_STATE 0
#define OFF_KEY_LEN 1
#define OFF_NS 4
#define OFF_SEQ 8
#define OFF_KEY 16
#define OFF_LEASE 80
#define OFF_CRC 88

enum { STATE_WRITING = 1, STATE_READY = 2, STATE_LEASED = 3 };

/* ---------------------------------------------------------------- CRC-32 (zlib's) */

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_of(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static inline void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* ---------------------------------------------------------------- a batch */

typedef struct {
    Py_buffer view;
    PyObject *slots;   /* PySequence_Fast */
    PyObject *keys;    /* PySequence_Fast, or NULL */
    Py_ssize_t n;
    Py_ssize_t *at;    /* each record's byte offset in the mapping */
} Batch;

static void batch_free(Batch *b) {
    PyMem_Free(b->at);
    Py_XDECREF(b->keys);
    Py_XDECREF(b->slots);
    if (b->view.obj != NULL)
        PyBuffer_Release(&b->view);
}

/* Check every slot (and key) and find each record; 0, or -1 with an exception set. */
static int batch_open(Batch *b, PyObject *table, Py_ssize_t table_offset, Py_ssize_t spe,
                      PyObject *extents, Py_ssize_t spe_max, PyObject *slots,
                      PyObject *keys) {
    memset(b, 0, sizeof(*b));
    if (spe <= 0 || spe_max < spe || table_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "bad slot table geometry");
        return -1;
    }
    if (!PyList_Check(extents)) {
        PyErr_SetString(PyExc_TypeError, "extents must be a list");
        return -1;
    }
    if (PyObject_GetBuffer(table, &b->view, PyBUF_WRITABLE) < 0)
        return -1;
    b->slots = PySequence_Fast(slots, "slots must be a sequence");
    if (b->slots == NULL)
        return -1;
    b->n = PySequence_Fast_GET_SIZE(b->slots);
    if (keys != NULL) {
        b->keys = PySequence_Fast(keys, "keys must be a sequence");
        if (b->keys == NULL)
            return -1;
    }
    b->at = PyMem_Malloc((size_t)(b->n ? b->n : 1) * sizeof(Py_ssize_t));
    if (b->at == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        /* fetched each time: an __index__ may have changed the list (never ours) */
        if (i >= PySequence_Fast_GET_SIZE(b->slots)) {
            PyErr_SetString(PyExc_RuntimeError, "slots changed size");
            return -1;
        }
        Py_ssize_t slot = PyNumber_AsSsize_t(PySequence_Fast_ITEMS(b->slots)[i],
                                             PyExc_OverflowError);
        if (slot == -1 && PyErr_Occurred())
            return -1;
        if (slot < 0 || slot / spe >= PyList_GET_SIZE(extents)) {
            PyErr_Format(PyExc_AssertionError, "slot %zd is not one of the namespace's", slot);
            return -1;
        }
        PyObject *ext_obj = PyList_GET_ITEM(extents, slot / spe);
        if (ext_obj == Py_None) {
            PyErr_Format(PyExc_AssertionError, "slot %zd lies in a hole", slot);
            return -1;
        }
        Py_ssize_t ext = PyNumber_AsSsize_t(ext_obj, PyExc_OverflowError);
        if (ext == -1 && PyErr_Occurred())
            return -1;
        if (ext < 0 || ext > (PY_SSIZE_T_MAX - table_offset) / RECORD_BYTES / spe_max - 1) {
            PyErr_Format(PyExc_IndexError, "extent %zd is outside the slot table", ext);
            return -1;
        }
        Py_ssize_t at = table_offset + (ext * spe_max + slot % spe) * RECORD_BYTES;
        if (at + RECORD_BYTES > b->view.len) {
            PyErr_Format(PyExc_IndexError, "slot %zd's record lies outside the mapping", slot);
            return -1;
        }
        b->at[i] = at;
    }
    /* the keys last: no Python code runs between their check and their use */
    if (b->keys != NULL) {
        if (PySequence_Fast_GET_SIZE(b->keys) < b->n) {
            PyErr_SetString(PyExc_ValueError, "fewer keys than slots");
            return -1;
        }
        for (Py_ssize_t i = 0; i < b->n; i++) {
            PyObject *key = PySequence_Fast_ITEMS(b->keys)[i];
            if (!PyBytes_Check(key)) {
                PyErr_SetString(PyExc_TypeError, "keys must be bytes");
                return -1;
            }
            if (PyBytes_GET_SIZE(key) > KEY_BYTES_MAX) {
                PyErr_Format(PyExc_ValueError, "a key of %zd bytes (at most %d)",
                             PyBytes_GET_SIZE(key), KEY_BYTES_MAX);
                return -1;
            }
        }
    }
    return 0;
}

#define BATCH_ARGS "OnnO!nO"

static PyObject *sr_writing(PyObject *mod, PyObject *args) {
    PyObject *table, *extents, *slots, *keys;
    Py_ssize_t table_offset, spe, spe_max;
    unsigned int ns;
    unsigned long long lease;
    if (!PyArg_ParseTuple(args, BATCH_ARGS "OIK", &table, &table_offset, &spe, &PyList_Type,
                          &extents, &spe_max, &slots, &keys, &ns, &lease))
        return NULL;
    Batch b;
    if (batch_open(&b, table, table_offset, spe, extents, spe_max, slots, keys) < 0) {
        batch_free(&b);
        return NULL;
    }
    uint8_t *base = b.view.buf;
    PyObject **ks = PySequence_Fast_ITEMS(b.keys);
    for (Py_ssize_t i = 0; i < b.n; i++) {
        uint8_t *r = base + b.at[i];
        Py_ssize_t klen = PyBytes_GET_SIZE(ks[i]);
        memset(r, 0, RECORD_BYTES);
        r[OFF_STATE] = STATE_WRITING;
        r[OFF_KEY_LEN] = (uint8_t)klen;
        put_le32(r + OFF_NS, ns);
        memcpy(r + OFF_KEY, PyBytes_AS_STRING(ks[i]), (size_t)klen);
        put_le64(r + OFF_LEASE, lease);
    }
    batch_free(&b);
    Py_RETURN_NONE;
}

static PyObject *sr_leased(PyObject *mod, PyObject *args) {
    PyObject *table, *extents, *slots;
    Py_ssize_t table_offset, spe, spe_max;
    unsigned int ns;
    unsigned long long lease;
    if (!PyArg_ParseTuple(args, BATCH_ARGS "IK", &table, &table_offset, &spe, &PyList_Type,
                          &extents, &spe_max, &slots, &ns, &lease))
        return NULL;
    Batch b;
    if (batch_open(&b, table, table_offset, spe, extents, spe_max, slots, NULL) < 0) {
        batch_free(&b);
        return NULL;
    }
    uint8_t *base = b.view.buf;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        uint8_t *r = base + b.at[i];
        memset(r, 0, RECORD_BYTES);
        r[OFF_STATE] = STATE_LEASED;
        put_le32(r + OFF_NS, ns);
        put_le64(r + OFF_LEASE, lease);
    }
    batch_free(&b);
    Py_RETURN_NONE;
}

static PyObject *sr_freed(PyObject *mod, PyObject *args) {
    PyObject *table, *extents, *slots;
    Py_ssize_t table_offset, spe, spe_max;
    if (!PyArg_ParseTuple(args, BATCH_ARGS, &table, &table_offset, &spe, &PyList_Type,
                          &extents, &spe_max, &slots))
        return NULL;
    Batch b;
    if (batch_open(&b, table, table_offset, spe, extents, spe_max, slots, NULL) < 0) {
        batch_free(&b);
        return NULL;
    }
    uint8_t *base = b.view.buf;
    for (Py_ssize_t i = 0; i < b.n; i++)
        memset(base + b.at[i], 0, RECORD_BYTES);
    batch_free(&b);
    Py_RETURN_NONE;
}

static PyObject *sr_ready(PyObject *mod, PyObject *args) {
    PyObject *table, *extents, *slots, *keys;
    Py_ssize_t table_offset, spe, spe_max;
    unsigned int ns;
    unsigned long long first_seq;
    if (!PyArg_ParseTuple(args, BATCH_ARGS "OIK", &table, &table_offset, &spe, &PyList_Type,
                          &extents, &spe_max, &slots, &keys, &ns, &first_seq))
        return NULL;
    Batch b;
    if (batch_open(&b, table, table_offset, spe, extents, spe_max, slots, keys) < 0) {
        batch_free(&b);
        return NULL;
    }
    uint8_t *base = b.view.buf;
    PyObject **ks = PySequence_Fast_ITEMS(b.keys);
    uint8_t msg[13 + KEY_BYTES_MAX];
    for (Py_ssize_t i = 0; i < b.n; i++) {
        uint8_t *r = base + b.at[i];
        uint64_t seq = first_seq + (uint64_t)i;
        Py_ssize_t klen = PyBytes_GET_SIZE(ks[i]);
        put_le32(msg, ns);
        put_le64(msg + 4, seq);
        msg[12] = (uint8_t)klen;
        memcpy(msg + 13, PyBytes_AS_STRING(ks[i]), (size_t)klen);
        put_le64(r + OFF_SEQ, seq);
        put_le32(r + OFF_CRC, crc32_of(msg, 13 + (size_t)klen));
        __atomic_store_n(r + OFF_STATE, (uint8_t)STATE_READY, __ATOMIC_RELEASE);
    }
    batch_free(&b);
    Py_RETURN_NONE;
}

static PyObject *sr_crc32(PyObject *mod, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t c = crc32_of(v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"writing", sr_writing, METH_VARARGS,
     "writing(table, table_offset, spe, extents, spe_max, slots, keys, ns, lease)"},
    {"leased", sr_leased, METH_VARARGS,
     "leased(table, table_offset, spe, extents, spe_max, slots, ns, lease)"},
    {"freed", sr_freed, METH_VARARGS, "freed(table, table_offset, spe, extents, spe_max, slots)"},
    {"ready", sr_ready, METH_VARARGS,
     "ready(table, table_offset, spe, extents, spe_max, slots, keys, ns, first_seq)"},
    {"crc32", sr_crc32, METH_O, "crc32(data): zlib's CRC-32, as ready records use it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slotrecords", "The region's slot records, a batch per call.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__slotrecords(void) {
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "RECORD_BYTES", RECORD_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "KEY_BYTES_MAX", KEY_BYTES_MAX) < 0 ||
        PyModule_AddIntConstant(m, "OFF_KEY_LEN", OFF_KEY_LEN) < 0 ||
        PyModule_AddIntConstant(m, "OFF_NS", OFF_NS) < 0 ||
        PyModule_AddIntConstant(m, "OFF_SEQ", OFF_SEQ) < 0 ||
        PyModule_AddIntConstant(m, "OFF_KEY", OFF_KEY) < 0 ||
        PyModule_AddIntConstant(m, "OFF_LEASE", OFF_LEASE) < 0 ||
        PyModule_AddIntConstant(m, "OFF_CRC", OFF_CRC) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
