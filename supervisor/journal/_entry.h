/* What the two C parsers (`_rows.c`, `_export.c`) share: the JournalEntry type's slots, set
 * through their descriptors, and a span of bytes. Each extension is its own translation unit,
 * so each has its own copy of these statics.
 */
#ifndef VLLM_SUPERVISOR_ENTRY_H
#define VLLM_SUPERVISOR_ENTRY_H

#include <Python.h>

#define N_SLOTS 13
#define N_LIFECYCLE 9

typedef struct {
    const char *p;
    Py_ssize_t n;
} Span;

static PyTypeObject *entry_type = NULL;
static PyObject *slot_descr[N_SLOTS];

static int all_digits(Span s) {
    if (s.n == 0)
        return 0;
    for (Py_ssize_t i = 0; i < s.n; i++)
        if (s.p[i] < '0' || s.p[i] > '9')
            return 0;
    return 1;
}

/* Keeps the setter descriptor of each of `cls`'s slots named in `names`; -1 with an error set. */
static int configure_slots(PyObject *cls, PyObject *names, PyObject *lifecycle) {
    if (PySequence_Size(names) != N_SLOTS || PySequence_Size(lifecycle) != N_LIFECYCLE) {
        PyErr_SetString(PyExc_ValueError, "configure: unexpected number of slots or fields");
        return -1;
    }
    for (int i = 0; i < N_SLOTS; i++) {
        PyObject *name = PySequence_GetItem(names, i);
        if (name == NULL)
            return -1;
        PyObject *descr = PyObject_GetAttr(cls, name);
        Py_DECREF(name);
        if (descr == NULL)
            return -1;
        if (Py_TYPE(descr)->tp_descr_set == NULL) {
            Py_DECREF(descr);
            PyErr_SetString(PyExc_TypeError, "configure: a slot without a setter");
            return -1;
        }
        Py_XSETREF(slot_descr[i], descr);
    }
    return 0;
}

/* A new entry with its slots set from `values` (stolen references). */
static PyObject *new_entry(PyObject **values) {
    PyObject *entry = entry_type->tp_alloc(entry_type, 0);
    int failed = entry == NULL;
    for (int i = 0; i < N_SLOTS; i++) {
        if (values[i] == NULL)
            failed = 1;
        else if (!failed && Py_TYPE(slot_descr[i])->tp_descr_set(slot_descr[i], entry, values[i]) < 0)
            failed = 1;
        Py_XDECREF(values[i]);
    }
    if (failed) {
        Py_XDECREF(entry);
        return NULL;
    }
    return entry;
}

#endif
