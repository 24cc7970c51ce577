/* journalctl's export format to JournalEntry objects, in C: `export.ExportDecoder`'s Python
 * path (`ExportParser.feed`, the units' match of `about`, `decode`), unchanged.
 *
 * The journalctl fallback reader parses every byte journalctl writes: ~14 us an entry in
 * Python, most of a backlog's catch-up past journalctl's own time. Like `_rows.c` this links
 * nothing but Python and reads only bytes from a pipe; the Python path stays as the reference
 * (and the fallback without a compiler), and tests/test_export_native.py holds the two equal on
 * arbitrary streams.
 *
 * configure(cls, slot_names, lifecycle_fields, message_text, field_int, empty) once, then
 * parse(buf, max_chars, max_length, units) -> (entries, first, last, consumed, invalid, parsed):
 * `max_length` the largest binary field taken before the stream counts as out of step, `units`
 * a set of unit names (bytes) or None for every entry; `consumed` is where the unparsed rest of
 * `buf` begins, `parsed` how many entries (of any unit) it held, `first`/`last` their first and
 * last cursor as `ExportDecoder.feed` reports them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_entry.h"

#include <stdint.h>
#include <string.h>


enum {
    F_CURSOR,
    F_REALTIME,
    F_MESSAGE,
    F_MESSAGE_ID,
    F_PRIORITY,
    F_PID,
    F_SERVICE_UNIT,
    F_SERVICE_INVOCATION,
    F_UNIT,
    F_INVOCATION,
    F_OBJECT_UNIT,
    F_UID,
    F_MACHINE_ID,
    F_HOSTNAME,
    F_BOOT_ID,
    F_LIFECYCLE, /* N_LIFECYCLE of them, in LIFECYCLE_FIELDS' order */
    N_FIELDS = F_LIFECYCLE + N_LIFECYCLE,
};

static const char *const fixed_names[F_LIFECYCLE] = {
    "__CURSOR", "__REALTIME_TIMESTAMP", "MESSAGE", "MESSAGE_ID", "PRIORITY",
    "_PID", "_SYSTEMD_UNIT", "_SYSTEMD_INVOCATION_ID", "UNIT", "INVOCATION_ID",
    "OBJECT_SYSTEMD_UNIT", "_UID", "_MACHINE_ID", "_HOSTNAME", "_BOOT_ID",
};

static char *field_names[N_FIELDS];
static Py_ssize_t field_lengths[N_FIELDS];
static PyObject *field_int = NULL;            /* field_int(raw: bytes) -> int | None */
static PyObject *empty_fields = NULL;


typedef struct {
    Span value[N_FIELDS];
    unsigned char present[N_FIELDS];
    int count; /* fields of any name: an entry with none is no entry */
} Fields;

static int field_index(const char *key, Py_ssize_t n) {
    for (int i = 0; i < N_FIELDS; i++)
        if (field_lengths[i] == n && memcmp(field_names[i], key, (size_t)n) == 0)
            return i;
    return -1;
}

static void set_field(Fields *f, const char *key, Py_ssize_t key_n, Span value) {
    f->count++;
    int i = field_index(key, key_n);
    if (i >= 0) { /* a repeated name: the last one counts, as in a dict */
        f->value[i] = value;
        f->present[i] = 1;
    }
}

static const char *find_pair(const char *p, const char *end) {
    /* The first "\n\n" in [p, end), or NULL. */
    while (p + 1 < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p - 1));
        if (nl == NULL)
            return NULL;
        if (nl[1] == '\n')
            return nl;
        p = nl + 1;
    }
    return NULL;
}

enum { DONE, INCOMPLETE };

/* `ExportParser._parse_exact` from `pos`: DONE with `*next` set (the fields in `f`, none when
 * an out-of-step stream was skipped), or INCOMPLETE when `buf` ends inside the entry. */
static int parse_exact(const char *buf, Py_ssize_t size, Py_ssize_t pos, unsigned long long max_length,
                       Fields *f, Py_ssize_t *next, Py_ssize_t *invalid) {
    memset(f, 0, sizeof *f);
    for (;;) {
        const char *nl = memchr(buf + pos, '\n', (size_t)(size - pos));
        if (nl == NULL)
            return INCOMPLETE;
        Py_ssize_t newline = nl - buf;
        if (newline == pos) { /* the blank line that ends the entry */
            *next = pos + 1;
            return DONE;
        }
        const char *eq = memchr(buf + pos, '=', (size_t)(newline - pos));
        if (eq != NULL) {
            set_field(f, buf + pos, eq - (buf + pos), (Span){eq + 1, nl - eq - 1});
            pos = newline + 1;
            continue;
        }
        Py_ssize_t start = newline + 1 + 8;
        if (start > size)
            return INCOMPLETE;
        unsigned long long length = 0;
        for (int i = 7; i >= 0; i--)
            length = (length << 8) | (unsigned char)buf[newline + 1 + i];
        if (length > max_length) {
            (*invalid)++; /* counted again on the next call if the blank line has not come */
            const char *skip = find_pair(buf + newline, buf + size);
            if (skip == NULL)
                return INCOMPLETE;
            memset(f, 0, sizeof *f);
            *next = (skip - buf) + 2;
            return DONE;
        }
        if ((unsigned long long)(size - start) < length + 1)
            return INCOMPLETE;
        set_field(f, buf + pos, newline - pos, (Span){buf + start, (Py_ssize_t)length});
        pos = start + (Py_ssize_t)length + 1;
    }
}

/* `field_int(value)`: digits in C, anything else (signs, spaces, underscores) as Python's int(). */
static PyObject *number(const Fields *f, int i) {
    if (!f->present[i])
        Py_RETURN_NONE;
    Span s = f->value[i];
    if (s.n <= 18 && all_digits(s)) {
        long long value = 0;
        for (Py_ssize_t k = 0; k < s.n; k++)
            value = value * 10 + (s.p[k] - '0');
        return PyLong_FromLongLong(value);
    }
    PyObject *raw = PyBytes_FromStringAndSize(s.p, s.n);
    if (raw == NULL)
        return NULL;
    PyObject *value = PyObject_CallOneArg(field_int, raw);
    Py_DECREF(raw);
    return value;
}

static PyObject *text(const Fields *f, int i, int utf8, int empty_is_none) {
    Span s = f->value[i];
    if (!f->present[i] || (empty_is_none && s.n == 0))
        Py_RETURN_NONE;
    return utf8 ? PyUnicode_DecodeUTF8(s.p, s.n, "replace") : PyUnicode_DecodeASCII(s.p, s.n, "replace");
}

static int is(const Fields *f, int i, char c) {
    return f->present[i] && f->value[i].n == 1 && f->value[i].p[0] == c;
}

/* `export.decode`: the entry of these fields (they hold a cursor). */
static PyObject *decode(const Fields *f, Py_ssize_t max_chars) {
    int trusted = is(f, F_PID, '1') || is(f, F_UID, '0');
    int unit = F_SERVICE_UNIT, invocation = F_SERVICE_INVOCATION;
    if (trusted && f->present[F_UNIT]) {
        unit = F_UNIT;
        invocation = F_INVOCATION;
    } else if (trusted && f->present[F_OBJECT_UNIT]) {
        unit = F_OBJECT_UNIT;
        invocation = -1;
    }
    PyObject *values[N_SLOTS];
    values[0] = text(f, F_CURSOR, 0, 0);
    values[1] = number(f, F_REALTIME);
    if (values[1] == Py_None || (values[1] != NULL && PyObject_Not(values[1]) == 1))
        Py_SETREF(values[1], PyLong_FromLong(0)); /* `field_int(...) or 0` */
    values[2] = message_of(f->present[F_MESSAGE] ? f->value[F_MESSAGE] : (Span){"", 0}, max_chars);
    values[3] = text(f, unit, 1, 0);
    values[4] = invocation < 0 ? Py_NewRef(Py_None) : text(f, invocation, 0, 0);
    values[5] = number(f, F_PID);
    values[6] = number(f, F_PRIORITY);
    values[7] = text(f, F_MESSAGE_ID, 0, 0);
    values[8] = Py_NewRef(is(f, F_PID, '1') ? Py_True : Py_False);
    values[9] = f->present[F_MESSAGE_ID] ? lifecycle_dict(&f->value[F_LIFECYCLE], &f->present[F_LIFECYCLE]) : Py_NewRef(empty_fields);
    values[10] = text(f, F_MACHINE_ID, 1, 1);
    values[11] = text(f, F_HOSTNAME, 1, 1);
    values[12] = text(f, F_BOOT_ID, 1, 1);
    return new_entry(values);
}

/* `about`: is this entry one of the units' (any of the three unit fields names one)? */
static int about(const Fields *f, PyObject *units) {
    static const int fields[] = {F_SERVICE_UNIT, F_UNIT, F_OBJECT_UNIT};
    for (int k = 0; k < 3; k++) {
        if (!f->present[fields[k]])
            continue;
        PyObject *name = PyBytes_FromStringAndSize(f->value[fields[k]].p, f->value[fields[k]].n);
        if (name == NULL)
            return -1;
        int found = PySet_Contains(units, name);
        Py_DECREF(name);
        if (found != 0)
            return found;
    }
    return 0;
}

static PyObject *cursor_of(const Fields *f, int none_if_absent) {
    if (!f->present[F_CURSOR])
        return none_if_absent ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize(f->value[F_CURSOR].p, f->value[F_CURSOR].n);
}

static PyObject *parse(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t max_chars;
    unsigned long long max_length;
    PyObject *units;
    if (!PyArg_ParseTuple(args, "y*nKO", &view, &max_chars, &max_length, &units))
        return NULL;
    if (entry_type == NULL) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "parse: configure() first");
        return NULL;
    }
    if (units != Py_None && !PyAnySet_Check(units)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "parse: units must be a set of bytes or None");
        return NULL;
    }
    const char *buf = view.buf;
    Py_ssize_t size = view.len, pos = 0, invalid = 0, parsed = 0;
    PyObject *first = NULL, *last = NULL;
    Fields f;
    PyObject *entries = PyList_New(0);
    if (entries == NULL)
        goto error;
    while (pos < size) {
        if (find_pair(buf + pos, buf + size) == NULL)
            break;
        Py_ssize_t next;
        if (parse_exact(buf, size, pos, max_length, &f, &next, &invalid) == INCOMPLETE)
            break;
        pos = next;
        if (f.count == 0)
            continue;
        parsed++;
        if (first == NULL && (first = cursor_of(&f, 0)) == NULL)
            goto error;
        Py_XSETREF(last, cursor_of(&f, 1));
        if (last == NULL)
            goto error;
        if (!f.present[F_CURSOR])
            continue;
        if (units != Py_None) {
            int wanted = about(&f, units);
            if (wanted < 0)
                goto error;
            if (!wanted)
                continue;
        }
        PyObject *entry = decode(&f, max_chars);
        if (entry == NULL)
            goto error;
        int appended = PyList_Append(entries, entry);
        Py_DECREF(entry);
        if (appended < 0)
            goto error;
    }
    PyBuffer_Release(&view);
    if (first == NULL)
        first = Py_NewRef(Py_None);
    if (last == NULL)
        last = Py_NewRef(Py_None);
    return Py_BuildValue("(NNNnnn)", entries, first, last, pos, invalid, parsed);
error:
    Py_XDECREF(entries);
    Py_XDECREF(first);
    Py_XDECREF(last);
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *cls, *names, *lifecycle, *text_fn, *int_fn, *empty;
    if (!PyArg_ParseTuple(args, "O!OOOOO", &PyType_Type, &cls, &names, &lifecycle, &text_fn, &int_fn,
                          &empty))
        return NULL;
    if (configure_slots(cls, names, lifecycle) < 0)
        return NULL;
    for (int i = 0; i < N_FIELDS; i++) {
        const char *name;
        Py_ssize_t length;
        PyObject *item = NULL;
        if (i < F_LIFECYCLE) {
            name = fixed_names[i];
            length = (Py_ssize_t)strlen(name);
        } else {
            item = PySequence_GetItem(lifecycle, i - F_LIFECYCLE);
            if (item == NULL)
                return NULL;
            if (!PyBytes_Check(item)) {
                Py_DECREF(item);
                PyErr_SetString(PyExc_TypeError, "configure: lifecycle fields must be bytes");
                return NULL;
            }
            name = PyBytes_AS_STRING(item);
            length = PyBytes_GET_SIZE(item);
            PyObject *key = PyUnicode_DecodeASCII(name, length, "strict");
            if (key == NULL) {
                Py_DECREF(item);
                return NULL;
            }
            Py_XSETREF(lifecycle_keys[i - F_LIFECYCLE], key);
        }
        char *copy = PyMem_Malloc((size_t)length + 1);
        if (copy == NULL) {
            Py_XDECREF(item);
            return PyErr_NoMemory();
        }
        memcpy(copy, name, (size_t)length + 1);
        Py_XDECREF(item);
        PyMem_Free(field_names[i]);
        field_names[i] = copy;
        field_lengths[i] = length;
    }
    Py_XSETREF(entry_type, (PyTypeObject *)Py_NewRef(cls));
    Py_XSETREF(message_text, Py_NewRef(text_fn));
    Py_XSETREF(field_int, Py_NewRef(int_fn));
    Py_XSETREF(empty_fields, Py_NewRef(empty));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the entry class, its slots and the helpers (once)."},
    {"parse", parse, METH_VARARGS,
     "Parse complete entries: (entries, first, last, consumed, invalid, parsed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_export",
    .m_doc = "journalctl's export format to JournalEntry objects (no libsystemd here).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__export(void) { return PyModule_Create(&module); }
