/* What the two C parsers (`_rows.c`, `_export.c`) share: the JournalEntry type's slots, set
 * through their descriptors, and a span of bytes. Each extension is its own translation unit,
 * so each has its own copy of these statics.
 */
#ifndef VLLM_SUPERVISOR_ENTRY_H
#define VLLM_SUPERVISOR_ENTRY_H

#include <Python.h>

#include <string.h>

#define N_SLOTS 13
#define N_LIFECYCLE 9

typedef struct {
    const char *p;
    Py_ssize_t n;
} Span;

static PyTypeObject *entry_type = NULL;
static PyObject *slot_descr[N_SLOTS];

static PyObject *message_text = NULL;         /* message_text(raw: bytes, max_chars: int) -> str */
static PyObject *lifecycle_keys[N_LIFECYCLE]; /* str: the lifecycle fields' keys, in order */

/* MESSAGE as str: decoded here when it is short and plain, else by `message_text` (the cut,
 * `\r` and NUL handling live in Python once). */
static PyObject *message_of(Span raw, Py_ssize_t max_chars) {
    if (raw.n <= max_chars && memchr(raw.p, '\r', (size_t)raw.n) == NULL &&
        memchr(raw.p, '\0', (size_t)raw.n) == NULL)
        return PyUnicode_DecodeUTF8(raw.p, raw.n, "replace");
    PyObject *bytes = PyBytes_FromStringAndSize(raw.p, raw.n);
    if (bytes == NULL)
        return NULL;
    PyObject *value = PyObject_CallFunction(message_text, "On", bytes, max_chars);
    Py_DECREF(bytes);
    return value;
}

/* The lifecycle fields as a dict of str under `lifecycle_keys`: those marked in `present`, or,
 * with no marks (NULL), those not empty. */
static PyObject *lifecycle_dict(const Span *values, const unsigned char *present) {
    PyObject *fields = PyDict_New();
    if (fields == NULL)
        return NULL;
    for (int i = 0; i < N_LIFECYCLE; i++) {
        if (present != NULL ? !present[i] : values[i].n == 0)
            continue;
        PyObject *decoded = PyUnicode_DecodeUTF8(values[i].p, values[i].n, "replace");
        if (decoded == NULL || PyDict_SetItem(fields, lifecycle_keys[i], decoded) < 0) {
            Py_XDECREF(decoded);
            Py_DECREF(fields);
            return NULL;
        }
        Py_DECREF(decoded);
    }
    return fields;
}

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
