/* The index's Block in C (policies.py): one stored block, its slot and reference count
 * (-1 being written, 0 ready, N pinned). The same attributes as the Python class; made
 * by a vectorcall constructor, so a store's batch of new blocks costs a fifth of the
 * Python class's __init__ per block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t slot;
    Py_ssize_t ref;
} Block;

static PyTypeObject BlockType;

static PyObject *block_make(PyTypeObject *type, PyObject *slot_obj) {
    Py_ssize_t slot = PyNumber_AsSsize_t(slot_obj, PyExc_OverflowError);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    Block *b = (Block *)type->tp_alloc(type, 0);
    if (b == NULL)
        return NULL;
    b->slot = slot;
    b->ref = -1;
    return (PyObject *)b;
}

static PyObject *Block_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Block(slot) takes one positional argument");
        return NULL;
    }
    return block_make((PyTypeObject *)type, args[0]);
}

static PyObject *Block_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 1 || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Block(slot) takes one positional argument");
        return NULL;
    }
    return block_make(type, PyTuple_GET_ITEM(args, 0));
}

static PyObject *Block_is_ready(Block *b, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(b->ref >= 0);
}

static PyObject *Block_repr(Block *b) {
    return PyUnicode_FromFormat("Block(slot=%zd, ref=%zd)", b->slot, b->ref);
}

static PyMemberDef Block_members[] = {
    {"slot", T_PYSSIZET, offsetof(Block, slot), 0, "The block's slot in its namespace."},
    {"ref", T_PYSSIZET, offsetof(Block, ref), 0, "-1 being written, 0 ready, N pinned."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Block_getset[] = {
    {"is_ready", (getter)Block_is_ready, NULL, "Whether the block is written whole.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffloadd.index._block.Block",
    .tp_basicsize = sizeof(Block),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One stored block: its slot and reference count (-1 writing, 0 ready, N pinned).",
    .tp_members = Block_members,
    .tp_getset = Block_getset,
    .tp_repr = (reprfunc)Block_repr,
    .tp_new = Block_new,
    .tp_vectorcall = Block_vectorcall,
};

static struct PyModuleDef block_module = {
    PyModuleDef_HEAD_INIT, "_block", "The index's Block in C (policies.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__block(void) {
    if (PyType_Ready(&BlockType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&block_module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&BlockType);
    if (PyModule_AddObject(mod, "Block", (PyObject *)&BlockType) < 0) {
        Py_DECREF(&BlockType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
