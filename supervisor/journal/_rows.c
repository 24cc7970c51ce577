/* The lean framing's rows to JournalEntry objects, in C: `export.LineParser`'s loop, unchanged.
 *
 * This runs in the daemon's own process, so it links nothing but Python: no libsystemd, no
 * mapped journal file, only bytes the reader child wrote to a pipe. Everything it does is
 * `LineParser.feed`'s pure-Python loop (which stays, and which tests/test_export.py compares
 * it with on arbitrary input); it exists because that loop was half the daemon's CPU per entry.
 *
 * configure(cls, slot_names, lifecycle_names, message_text, empty) once, then
 * parse(buf, max_chars) -> (entries, first, last, consumed, invalid, synced), where `consumed`
 * is where the unparsed rest of `buf` begins and `synced` the highest sync answer (0: none).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_entry.h"

#include <string.h>

#define N_COLUMNS (2 + 12 + N_LIFECYCLE + 1)
#define LIFECYCLE_AT 14

static PyObject *empty_fields = NULL;


/* int(s) for ASCII digits (isdigit already checked); arbitrary size like Python's. */
static PyObject *to_int(Span s) {
    if (s.n <= 18) {
        long long value = 0;
        for (Py_ssize_t i = 0; i < s.n; i++)
            value = value * 10 + (s.p[i] - '0');
        return PyLong_FromLongLong(value);
    }
    char *copy = PyMem_Malloc((size_t)s.n + 1);
    if (copy == NULL)
        return PyErr_NoMemory();
    memcpy(copy, s.p, (size_t)s.n);
    copy[s.n] = '\0';
    PyObject *value = PyLong_FromString(copy, NULL, 10);
    PyMem_Free(copy);
    return value;
}

static PyObject *int_or(Span s, PyObject *otherwise) {
    if (all_digits(s))
        return to_int(s);
    Py_INCREF(otherwise);
    return otherwise;
}

/* The text of an optional identifier: None when empty. */
static PyObject *text_or_none(Span s, int utf8) {
    if (s.n == 0)
        Py_RETURN_NONE;
    return utf8 ? PyUnicode_DecodeUTF8(s.p, s.n, "replace") : PyUnicode_DecodeASCII(s.p, s.n, "replace");
}

static int same(Span a, Span b) { return a.n == b.n && memcmp(a.p, b.p, (size_t)a.n) == 0; }

/* The identity fields of the previous row and their Python values (reused while equal). */
#define N_IDENTITY 7
typedef struct {
    int valid;
    Span raw[N_IDENTITY];
    PyObject *value[N_IDENTITY];
} Identity;

static void identity_clear(Identity *id) {
    for (int i = 0; i < N_IDENTITY; i++)
        Py_CLEAR(id->value[i]);
    id->valid = 0;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *cls, *names, *lifecycle, *text, *empty;
    if (!PyArg_ParseTuple(args, "O!OOOO", &PyType_Type, &cls, &names, &lifecycle, &text, &empty))
        return NULL;
    if (configure_slots(cls, names, lifecycle) < 0)
        return NULL;
    for (int i = 0; i < N_LIFECYCLE; i++) {
        PyObject *name = PySequence_GetItem(lifecycle, i);
        if (name == NULL)
            return NULL;
        Py_XSETREF(lifecycle_keys[i], name);
    }
    Py_INCREF(cls);
    Py_XSETREF(entry_type, (PyTypeObject *)cls);
    Py_INCREF(text);
    Py_XSETREF(message_text, text);
    Py_INCREF(empty);
    Py_XSETREF(empty_fields, empty);
    Py_RETURN_NONE;
}

static PyObject *parse(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t max_chars;
    if (!PyArg_ParseTuple(args, "y*n", &view, &max_chars))
        return NULL;
    if (entry_type == NULL) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "parse: configure() first");
        return NULL;
    }
    const char *buf = view.buf;
    Py_ssize_t size = view.len, pos = 0, invalid = 0;
    PyObject *synced = PyLong_FromLong(0);
    if (synced == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Span first = {NULL, 0}, last = {NULL, 0};
    int have_first = 0, have_last = 0;
    Identity id = {0};
    PyObject *entries = PyList_New(0);
    if (entries == NULL)
        goto error;
    for (;;) {
        const char *nl = memchr(buf + pos, '\n', (size_t)(size - pos));
        if (nl == NULL)
            break;
        Py_ssize_t newline = nl - buf;
        Span cols[N_COLUMNS];
        int count = 0, overflow = 0;
        const char *start = buf + pos;
        for (const char *c = start; c <= nl; c++) {
            if (c == nl || *c == '\t') {
                if (count < N_COLUMNS)
                    cols[count] = (Span){start, c - start};
                else
                    overflow = 1;
                count++;
                start = c + 1;
            }
        }
        if (overflow || count != N_COLUMNS || !all_digits(cols[N_COLUMNS - 1])) {
            if (count == 1 && cols[0].n > 0 && cols[0].p[0] == '#') { /* a sync answer */
                Span number = {cols[0].p + 1, cols[0].n - 1};
                if (all_digits(number)) {
                    PyObject *value = to_int(number);
                    if (value == NULL)
                        goto error;
                    int higher = PyObject_RichCompareBool(value, synced, Py_GT);
                    if (higher < 0) {
                        Py_DECREF(value);
                        goto error;
                    }
                    if (higher)
                        Py_SETREF(synced, value);
                    else
                        Py_DECREF(value);
                } else {
                    invalid++;
                }
            } else if (count == 1) { /* a cursor-only record */
                last = cols[0];
                have_last = 1;
                if (!have_first || first.n == 0) {
                    first = last;
                    have_first = 1;
                }
            } else {
                invalid++; /* out of step: resynchronise at the next line */
            }
            pos = newline + 1;
            continue;
        }
        Span length = cols[N_COLUMNS - 1];
        Py_ssize_t message_len = 0;
        int too_long = length.n > 15;
        for (Py_ssize_t i = 0; !too_long && i < length.n; i++)
            message_len = message_len * 10 + (length.p[i] - '0');
        if (too_long || message_len >= size - newline - 1)
            break; /* the message (and its newline) has not all arrived */
        Py_ssize_t end = newline + 1 + message_len;
        Span cursor = cols[0], realtime = cols[1], message_id = cols[2], priority = cols[3];
        Span pid = cols[4], service_unit = cols[5], service_inv = cols[6], about_unit = cols[7];
        Span about_inv = cols[8], object_unit = cols[9], uid = cols[10];
        int trusted = (pid.n == 1 && pid.p[0] == '1') || (uid.n == 1 && uid.p[0] == '0');
        Span unit = service_unit, invocation = service_inv;
        if (about_unit.n && trusted) {
            unit = about_unit;
            invocation = about_inv;
        } else if (object_unit.n && trusted) {
            unit = object_unit;
            invocation = (Span){"", 0};
        }
        Span identity[N_IDENTITY] = {unit, invocation, pid, priority, cols[11], cols[12], cols[13]};
        int fresh = !id.valid;
        for (int i = 0; !fresh && i < N_IDENTITY; i++)
            fresh = !same(identity[i], id.raw[i]);
        if (fresh) {
            identity_clear(&id);
            id.value[0] = text_or_none(unit, 1);
            id.value[1] = text_or_none(invocation, 0);
            id.value[2] = int_or(pid, Py_None);
            id.value[3] = int_or(priority, Py_None);
            id.value[4] = text_or_none(cols[11], 0);
            id.value[5] = text_or_none(cols[12], 1);
            id.value[6] = text_or_none(cols[13], 0);
            for (int i = 0; i < N_IDENTITY; i++) {
                if (id.value[i] == NULL)
                    goto error;
                id.raw[i] = identity[i];
            }
            id.valid = 1;
        }
        PyObject *values[N_SLOTS];
        values[0] = PyUnicode_DecodeASCII(cursor.p, cursor.n, "replace");
        values[1] = all_digits(realtime) ? to_int(realtime) : PyLong_FromLong(0);
        values[2] = message_of((Span){buf + newline + 1, message_len}, max_chars);
        values[3] = Py_NewRef(id.value[0]);
        values[4] = Py_NewRef(id.value[1]);
        values[5] = Py_NewRef(id.value[2]);
        values[6] = Py_NewRef(id.value[3]);
        values[7] = text_or_none(message_id, 0);
        values[8] = Py_NewRef((pid.n == 1 && pid.p[0] == '1') ? Py_True : Py_False);
        values[9] = message_id.n ? lifecycle_dict(&cols[LIFECYCLE_AT], NULL) : Py_NewRef(empty_fields);
        values[10] = Py_NewRef(id.value[4]);
        values[11] = Py_NewRef(id.value[5]);
        values[12] = Py_NewRef(id.value[6]);
        PyObject *entry = new_entry(values);
        if (entry == NULL)
            goto error;
        int appended = PyList_Append(entries, entry);
        Py_DECREF(entry);
        if (appended < 0)
            goto error;
        last = cursor;
        have_last = 1;
        if (!have_first || first.n == 0) {
            first = cursor;
            have_first = 1;
        }
        pos = end + 1;
    }
    identity_clear(&id);
    PyObject *first_obj =
        have_first ? PyBytes_FromStringAndSize(first.p, first.n) : Py_NewRef(Py_None);
    PyObject *last_obj = have_last ? PyBytes_FromStringAndSize(last.p, last.n) : Py_NewRef(Py_None);
    PyBuffer_Release(&view);
    if (first_obj == NULL || last_obj == NULL) {
        Py_XDECREF(first_obj);
        Py_XDECREF(last_obj);
        Py_DECREF(entries);
        Py_DECREF(synced);
        return NULL;
    }
    return Py_BuildValue("(NNNnnN)", entries, first_obj, last_obj, pos, invalid, synced);
error:
    identity_clear(&id);
    Py_XDECREF(entries);
    Py_XDECREF(synced);
    PyBuffer_Release(&view);
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the entry class and its slots (once)."},
    {"parse", parse, METH_VARARGS, "Parse complete rows: (entries, first, last, consumed, invalid, synced)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_rows",
    .m_doc = "The native reader's rows to JournalEntry objects (no libsystemd here).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
