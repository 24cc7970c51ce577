/* The native journal source: libsystemd's sd_journal API, as a program of its own.
 *
 * `vllm-supervisor-journal-reader` runs as the supervisor's child and the supervisor reads its
 * stdout as it reads `journalctl -o export` (or, with --lines, in the lean framing of
 * `write_lines`). The child is not a convenience: readers linked to libsystemd have died with
 * SIGBUS while journald rotated files before systemd 255, and such a death must only cost a
 * restart from the cursor. It is plain C, not a Python interpreter running an extension, so it
 * starts in about a millisecond and holds ~3 MB instead of ~15 MB.
 *
 * Why it is faster than journalctl (~80k entries/s here with every field, ~53k/s with
 * --output-fields): each entry's data is enumerated once and only the wanted fields are written
 * (journalctl 252 looks every --output-fields name up per entry), there is no per-field
 * printability check, and output goes through one large buffer.
 *
 * Its memory stays bounded whatever the journal holds (any local user can log a native entry of
 * hundreds of MiB). libsystemd 252 decompresses a field whole, whatever
 * sd_journal_set_data_threshold() says, into a buffer of the journal file it came from, which
 * keeps the largest size it ever held until the file is closed; and it maps a large object whole.
 * A backlog of 16 MiB entries over 20 journal files left this program holding 336 MiB. So values
 * are cut to the data threshold here (the caller never needs more), and once oversized fields
 * were read the journal is closed and opened again at the same entry, which frees all of that.
 * One oversized field at a time is the peak.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <systemd/sd-journal.h>
#include <unistd.h>

#define OUT_SIZE (1 << 20)
#define MAX_FIELDS 64
/* A run of entries of other units is summarised by one cursor-only record at most this often,
 * so the caller's checkpoint keeps moving on a journal busy with other units. */
#define SKIPPED_CURSOR_EVERY 4096
/* Once the fields over the data threshold read since the journal was opened add up to this
 * many bytes, it is opened again (see the top of this file); and at the end of every pass that
 * read any. Small enough that a backlog holds at most one such buffer next to the one in use. */
#define REOPEN_AFTER_BYTES (16u << 20)
/* The allocator's default point above which a block gets pages of its own, made fixed: glibc
 * raises it to the size of each such block freed (up to 32 MiB), after which a freed 16 MiB
 * buffer stays in the heap instead of going back to the kernel. */
#define OWN_PAGES_FROM (128 * 1024)

typedef struct {
    char buf[OUT_SIZE];
    size_t len;
} Out;

typedef struct {
    const char *name;
    size_t len;
} Name;

static int out_flush(Out *out) {
    size_t done = 0;
    while (done < out->len) {
        ssize_t n = write(STDOUT_FILENO, out->buf + done, out->len - done);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        done += (size_t)n;
    }
    out->len = 0;
    return 0;
}

static int out_put(Out *out, const void *data, size_t size) {
    if (out->len + size > OUT_SIZE) {
        int r = out_flush(out);
        if (r < 0)
            return r;
    }
    if (size > OUT_SIZE) { /* larger than the buffer: write it straight through */
        const char *p = data;
        while (size > 0) {
            ssize_t n = write(STDOUT_FILENO, p, size);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            p += n;
            size -= (size_t)n;
        }
        return 0;
    }
    memcpy(out->buf + out->len, data, size);
    out->len += size;
    return 0;
}

static int out_cursor(Out *out, sd_journal *j) {
    char *cursor = NULL;
    int r = sd_journal_get_cursor(j, &cursor);
    if (r < 0)
        return r;
    if ((r = out_put(out, "__CURSOR=", 9)) >= 0 && (r = out_put(out, cursor, strlen(cursor))) >= 0)
        r = out_put(out, "\n", 1);
    free(cursor);
    return r;
}

/* The index of the item's field in `names`, or -1; its name's length in *name_len. */
static int wanted(const Name *names, size_t count, const char *item, size_t size,
                  size_t *name_len) {
    const char *eq = memchr(item, '=', size);
    if (eq == NULL)
        return -1;
    size_t len = (size_t)(eq - item);
    for (size_t i = 0; i < count; i++)
        if (names[i].len == len && memcmp(names[i].name, item, len) == 0) {
            *name_len = len;
            return (int)i;
        }
    return -1;
}

/* Is the entry about one of `units` (its _SYSTEMD_UNIT, UNIT or OBJECT_SYSTEMD_UNIT)? */
static int about(const Name *units, size_t count, const char *item, size_t size, size_t name_len) {
    static const char *unit_fields[] = {"_SYSTEMD_UNIT", "UNIT", "OBJECT_SYSTEMD_UNIT"};
    int is_unit_field = 0;
    for (size_t f = 0; f < 3; f++)
        if (strlen(unit_fields[f]) == name_len && memcmp(unit_fields[f], item, name_len) == 0)
            is_unit_field = 1;
    if (!is_unit_field)
        return 0;
    const char *value = item + name_len + 1;
    size_t value_len = size - name_len - 1;
    for (size_t i = 0; i < count; i++)
        if (units[i].len == value_len && memcmp(units[i].name, value, value_len) == 0)
            return 1;
    return 0;
}

typedef struct {
    Name fields[MAX_FIELDS];
    size_t n_fields;
    Name units[MAX_FIELDS];
    size_t n_units;
    int filter_units; /* match the units on the fields here (following) */
    int lines;        /* the lean framing (see write_lines) instead of export format */
    int message;      /* the index of MESSAGE in fields, or -1 */
    size_t max_value; /* a value is cut to this many bytes (the data threshold); 0: never */
} Selection;

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_put(Buf *b, const void *data, size_t size) {
    if (b->len + size > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + size)
            cap *= 2;
        char *grown = realloc(b->data, cap);
        if (grown == NULL)
            return -ENOMEM;
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, size);
    b->len += size;
    return 0;
}

/* One FIELD=VALUE item as export format writes it: text, or binary when it holds a newline.
 * The value is `value_len` bytes long (a cut one is shorter than the item's). */
static int put_field(Buf *b, const char *item, size_t value_len, size_t name_len) {
    const char *value = item + name_len + 1;
    int r;
    if (memchr(value, '\n', value_len) == NULL) {
        r = buf_put(b, item, name_len + 1 + value_len);
        return r < 0 ? r : buf_put(b, "\n", 1);
    }
    unsigned char length[8];
    uint64_t v = value_len;
    for (int i = 0; i < 8; i++)
        length[i] = (unsigned char)(v >> (8 * i));
    if ((r = buf_put(b, item, name_len)) < 0 || (r = buf_put(b, "\n", 1)) < 0 ||
        (r = buf_put(b, length, 8)) < 0 || (r = buf_put(b, value, value_len)) < 0)
        return r;
    return buf_put(b, "\n", 1);
}

/* The lean framing, one entry:
 *   CURSOR \t REALTIME \t FIELD1 \t ... \t FIELDn \t MESSAGE_LENGTH \n MESSAGE \n
 * with the fields in the order asked for (MESSAGE left out of the row), an absent field empty.
 * The parent splits one line per entry instead of building a dict of KEY=VALUE lines. A tab or
 * newline inside a row value (never in a cursor, number, id or valid unit name) becomes '?'.
 * A cursor-only record is a line with the cursor alone. */
static int write_lines(Out *out, Buf *entry, sd_journal *j, const Selection *sel,
                       const size_t *offsets, const size_t *lengths) {
    uint64_t realtime;
    int r;
    if ((r = sd_journal_get_realtime_usec(j, &realtime)) < 0)
        return r;
    char stamp[32];
    int len = snprintf(stamp, sizeof stamp, "\t%llu", (unsigned long long)realtime);
    char *cursor = NULL;
    if ((r = sd_journal_get_cursor(j, &cursor)) < 0)
        return r;
    r = out_put(out, cursor, strlen(cursor));
    free(cursor);
    if (r < 0 || (r = out_put(out, stamp, (size_t)len)) < 0)
        return r;
    for (size_t i = 0; i < sel->n_fields; i++) {
        if ((int)i == sel->message)
            continue;
        if ((r = out_put(out, "\t", 1)) < 0)
            return r;
        if (lengths[i] == 0)
            continue;
        char *value = entry->data + offsets[i];
        for (size_t k = 0; k < lengths[i]; k++)
            if (value[k] == '\t' || value[k] == '\n')
                value[k] = '?';
        if ((r = out_put(out, value, lengths[i])) < 0)
            return r;
    }
    size_t message_len = sel->message >= 0 ? lengths[sel->message] : 0;
    len = snprintf(stamp, sizeof stamp, "\t%zu\n", message_len);
    if ((r = out_put(out, stamp, (size_t)len)) < 0)
        return r;
    if (message_len > 0 && (r = out_put(out, entry->data + offsets[sel->message], message_len)) < 0)
        return r;
    r = out_put(out, "\n", 1);
    return r < 0 ? r : 1;
}

/* Write the current entry; 1 when written, 0 when it is not about the units, <0 on error.
 * Data returned by libsystemd is only valid until the next call, so each wanted field is copied
 * into `entry` at once (cut to sel->max_value bytes); the entry reaches the output only if it is
 * about the units. The sizes of the fields over sel->max_value are added to *oversized. */
static int write_entry(Out *out, Buf *entry, sd_journal *j, const Selection *sel,
                       size_t *oversized) {
    const void *data;
    size_t size;
    int matched = !sel->filter_units;
    int r;
    entry->len = 0;
    sd_journal_restart_data(j);
    size_t offsets[MAX_FIELDS], lengths[MAX_FIELDS];
    for (size_t i = 0; i < sel->n_fields; i++)
        offsets[i] = lengths[i] = 0;
    while ((r = sd_journal_enumerate_available_data(j, &data, &size)) > 0) {
        if (sel->max_value > 0 && size > sel->max_value)
            *oversized += size;
        size_t name_len;
        int index = wanted(sel->fields, sel->n_fields, data, size, &name_len);
        if (index < 0)
            continue;
        if (!matched && about(sel->units, sel->n_units, data, size, name_len))
            matched = 1;
        size_t value_len = size - name_len - 1;
        if (sel->max_value > 0 && value_len > sel->max_value)
            value_len = sel->max_value;
        if (sel->lines) { /* the value only; a repeated field keeps its last value */
            offsets[index] = entry->len;
            lengths[index] = value_len;
            r = buf_put(entry, (const char *)data + name_len + 1, value_len);
        } else
            r = put_field(entry, data, value_len, name_len);
        if (r < 0)
            return r;
    }
    if (r < 0)
        return r;
    if (!matched)
        return 0;
    if (sel->lines)
        return write_lines(out, entry, j, sel, offsets, lengths);
    uint64_t realtime;
    if ((r = sd_journal_get_realtime_usec(j, &realtime)) < 0)
        return r;
    char stamp[48];
    int len = snprintf(stamp, sizeof stamp, "__REALTIME_TIMESTAMP=%llu\n",
                       (unsigned long long)realtime);
    if ((r = out_cursor(out, j)) < 0 || (r = out_put(out, stamp, (size_t)len)) < 0 ||
        (r = out_put(out, entry->data, entry->len)) < 0)
        return r;
    r = out_put(out, "\n", 1);
    return r < 0 ? r : 1;
}

/* Sync requests: the parent writes "N\n" to our stdin, and once the journal has been read to its
 * end in a pass that began after N arrived, "#N" follows that pass's entries (a row of its own,
 * never a cursor). The parent then knows that everything in the journal files before it asked
 * has been handed over. The highest number pending is kept; -1 once stdin is gone. */
static long long sync_wanted = 0;
static int sync_fd = STDIN_FILENO;
static char sync_partial[32];
static size_t sync_partial_len = 0;

static void read_sync_requests(void) {
    char buf[256];
    ssize_t n = read(sync_fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        sync_fd = -1; /* closed, or not a pipe: no more requests */
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        if (buf[i] != '\n') {
            if (sync_partial_len < sizeof sync_partial - 1)
                sync_partial[sync_partial_len++] = buf[i];
            continue;
        }
        sync_partial[sync_partial_len] = '\0';
        long long wanted = strtoll(sync_partial, NULL, 10);
        if (wanted > sync_wanted)
            sync_wanted = wanted;
        sync_partial_len = 0;
    }
}

/* Wait for journal changes or a sync request, at most `timeout_ms` (-1: libsystemd's own
 * timeout, if any); return -EPIPE when our reader (stdout's other end) has gone away. */
static int wait_for_change(sd_journal *j, int timeout_ms) {
    int fd = sd_journal_get_fd(j);
    if (fd < 0)
        return fd;
    int events = sd_journal_get_events(j);
    if (events < 0)
        return events;
    if (timeout_ms < 0) {
        uint64_t timeout_us;
        int r = sd_journal_get_timeout(j, &timeout_us);
        if (r < 0)
            return r;
        if (timeout_us != (uint64_t)-1) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            uint64_t now_us = (uint64_t)now.tv_sec * 1000000 + (uint64_t)now.tv_nsec / 1000;
            timeout_ms = timeout_us > now_us ? (int)((timeout_us - now_us + 999) / 1000) : 0;
        }
    } else {
        fd = -1; /* lingering: only a sync request (or the reader going away) ends the wait */
    }
    struct pollfd fds[3] = {{.fd = fd, .events = (short)events},
                            {.fd = STDOUT_FILENO, .events = 0},
                            {.fd = sync_fd, .events = POLLIN}};
    int r = poll(fds, 3, timeout_ms);
    if (r < 0)
        return errno == EINTR ? 0 : -errno;
    if (fds[1].revents & (POLLERR | POLLHUP))
        return -EPIPE;
    if (fds[2].revents & (POLLIN | POLLHUP | POLLERR))
        read_sync_requests();
    r = sd_journal_process(j);
    return r < 0 ? r : 0;
}

static int usage_error(const char *message, const char *value);

static int add_name(Name *names, size_t *count, const char *name, const char *what) {
    if (*count >= MAX_FIELDS)
        return usage_error(what, name);
    names[*count].name = name;
    names[*count].len = strlen(name);
    (*count)++;
    return 0;
}

static int add_unit_matches(sd_journal *j, const Selection *sel) {
    /* What `journalctl --unit` matches on systemd 252 (add_matches_for_unit). */
    char m[4][512];
    for (size_t i = 0; i < sel->n_units; i++) {
        int len = (int)sel->units[i].len;
        const char *u = sel->units[i].name;
        snprintf(m[0], sizeof m[0], "_SYSTEMD_UNIT=%.*s", len, u);
        snprintf(m[1], sizeof m[1], "COREDUMP_UNIT=%.*s", len, u);
        snprintf(m[2], sizeof m[2], "UNIT=%.*s", len, u);
        snprintf(m[3], sizeof m[3], "OBJECT_SYSTEMD_UNIT=%.*s", len, u);
        int r;
        if ((r = sd_journal_add_match(j, m[0], 0)) < 0 || (r = sd_journal_add_disjunction(j)) < 0 ||
            (r = sd_journal_add_match(j, "MESSAGE_ID=fc2e22bc6ee647b6b90729ab34a250b1", 0)) < 0 ||
            (r = sd_journal_add_match(j, "_UID=0", 0)) < 0 || (r = sd_journal_add_match(j, m[1], 0)) < 0 ||
            (r = sd_journal_add_disjunction(j)) < 0 || (r = sd_journal_add_match(j, "_PID=1", 0)) < 0 ||
            (r = sd_journal_add_match(j, m[2], 0)) < 0 || (r = sd_journal_add_disjunction(j)) < 0 ||
            (r = sd_journal_add_match(j, "_UID=0", 0)) < 0 || (r = sd_journal_add_match(j, m[3], 0)) < 0 ||
            (r = sd_journal_add_disjunction(j)) < 0)
            return r;
    }
    return 0;
}

static int fail(const char *what, int r) {
    /* journalctl's wording, which the parent's "was the cursor refused" check looks for. */
    fprintf(stderr, "%s: %s\n", what, strerror(r < 0 ? -r : r));
    return 1;
}

typedef struct {
    const char *directory;
    const char *files[MAX_FIELDS + 1]; /* NULL-terminated */
    size_t n_files;
    const char *cursor;
    const char *start;
    long data_threshold;
    long linger_ms;
} Options;

static int open_journal(sd_journal **j, const char *directory, const char **files) {
    if (files[0] != NULL)
        return sd_journal_open_files(j, files, 0);
    if (directory != NULL)
        return sd_journal_open_directory(j, directory, 0);
    return sd_journal_open(j, SD_JOURNAL_LOCAL_ONLY);
}

static int position(sd_journal *j, const char *cursor, const char *start) {
    int r;
    if (cursor != NULL) {
        /* Inclusive like journalctl --cursor: the next entry read is the cursor's own. */
        if ((r = sd_journal_seek_cursor(j, cursor)) < 0)
            return fail("Failed to seek to cursor", r);
        return 0;
    }
    if (strcmp(start, "head") == 0) {
        if ((r = sd_journal_seek_head(j)) < 0)
            return fail("Failed to seek to head", r);
        return 0;
    }
    if ((r = sd_journal_seek_tail(j)) < 0)
        return fail("Failed to seek to tail", r);
    if (strcmp(start, "last") == 0)
        return 0;
    /* "tail": step onto the last entry so that only later ones are read. */
    r = sd_journal_previous(j);
    return r < 0 ? fail("Failed to seek to tail", r) : 0;
}

typedef struct {
    sd_journal *j;
    Options *options; /* what to open, again at each reopen */
    Out *out;
    Buf entry;
    Selection sel;
    int follow;
    uint64_t linger_us;
    size_t oversized; /* bytes of fields over the data threshold read since the journal opened */
} Run;

/* Open the journal the options name, as selected: the data threshold, the unit matches when
 * reading once; when following, its inotify watch at once, so that no change after the open is
 * missed. 0, or 1 with a message naming what failed. */
static int open_selected(Run *run) {
    Options *o = run->options;
    int r = open_journal(&run->j, o->directory, o->files);
    if (r < 0)
        return fail("Failed to open journal", r);
    /* Only sd_journal_enumerate_unique() honours it on 252; write_entry cuts the values. */
    if (o->data_threshold > 0 &&
        (r = sd_journal_set_data_threshold(run->j, (size_t)o->data_threshold)) < 0)
        return fail("Failed to set data threshold", r);
    if (run->sel.n_units > 0 && !run->follow && (r = add_unit_matches(run->j, &run->sel)) < 0)
        return fail("Failed to add unit matches", r);
    if (run->follow && (r = sd_journal_get_fd(run->j)) < 0)
        return fail("Failed to watch journal", r);
    run->oversized = 0;
    return 0;
}

/* Close the journal and open it again on the current entry (see the top of this file), so that
 * the next sd_journal_next() returns the entry after it; if the current entry went away in
 * between (vacuumed), the first entry after it. 0, or 1 with a message. */
static int reopen(Run *run) {
    char *cursor = NULL;
    int r = sd_journal_get_cursor(run->j, &cursor);
    if (r < 0)
        return fail("Failed to reopen journal", r);
    sd_journal_close(run->j);
    run->j = NULL;
    (void)malloc_trim(0); /* the freed heap too, not only the blocks with pages of their own */
    int status = open_selected(run);
    if (status == 0 && (r = sd_journal_seek_cursor(run->j, cursor)) >= 0 &&
        (r = sd_journal_next(run->j)) > 0 && (r = sd_journal_test_cursor(run->j, cursor)) == 0) {
        /* On the entry after the vacuumed one: step back, so that it is the next one read. */
        r = sd_journal_previous(run->j);
        if (r == 0) /* nothing before it: it is the journal's first entry */
            r = sd_journal_seek_head(run->j);
    }
    free(cursor);
    if (status == 0 && r < 0)
        status = fail("Failed to reopen journal", r);
    return status;
}

static int cursor_record(Run *run) {
    /* A cursor-only record: the checkpoint moves past entries nobody asked for. */
    if (run->sel.lines) {
        char *cursor = NULL;
        int r = sd_journal_get_cursor(run->j, &cursor);
        if (r < 0)
            return r;
        r = out_put(run->out, cursor, strlen(cursor));
        free(cursor);
        return r < 0 ? r : out_put(run->out, "\n", 1);
    }
    int r = out_cursor(run->out, run->j);
    return r < 0 ? r : out_put(run->out, "\n", 1);
}

/* A busy journal changes on every entry (journal-remote, journald under load): reading at each
 * change would wake both processes once per line. So after a read that found entries, wait
 * `linger_us` and read again without waiting for a change: a steady stream costs one wake-up and
 * one batch per interval. A quiet journal's next entry is still read at its change, and a sync
 * request cuts the wait short. */
static int linger(sd_journal *j, uint64_t linger_us) {
    return wait_for_change(j, (int)((linger_us + 999) / 1000));
}

static int write_sync(Out *out, long long number) {
    char row[32];
    int len = snprintf(row, sizeof row, "#%lld\n", number);
    return out_put(out, row, (size_t)len);
}

static int stream_loop(Run *run, int first_is_cursor) {
    long skipped = 0; /* entries of other units since the last record written */
    long written = 0; /* records written since the last wait */
    long long syncing = 0; /* the request this pass answers when it reaches the end */
    int r;
    for (;;) {
        r = sd_journal_next(run->j);
        if (r < 0)
            return fail("Failed to iterate through journal", r);
        if (r > 0) {
            r = write_entry(run->out, &run->entry, run->j, &run->sel, &run->oversized);
            /* The entry a cursor seek lands on is always reported, if only by its cursor, so the
             * parent sees whether the saved entry is still there. */
            long every = first_is_cursor ? 1 : SKIPPED_CURSOR_EVERY;
            first_is_cursor = 0;
            if (r == 0 && ++skipped >= every && (r = cursor_record(run)) >= 0)
                skipped = 0, written++;
            else if (r > 0)
                skipped = 0, written++;
            if (r < 0)
                return r == -EPIPE ? 0 : fail("Failed to write entry", r);
            if (run->oversized >= REOPEN_AFTER_BYTES && reopen(run) != 0)
                return 1;
            continue;
        }
        if (skipped > 0 && (r = cursor_record(run)) < 0)
            return r == -EPIPE ? 0 : fail("Failed to write entry", r);
        written += skipped > 0;
        skipped = 0;
        if (syncing > 0 && (r = write_sync(run->out, syncing)) < 0)
            return r == -EPIPE ? 0 : fail("Failed to write", r);
        syncing = 0;
        if ((r = out_flush(run->out)) < 0)
            return r == -EPIPE ? 0 : fail("Failed to write", r);
        if (!run->follow)
            return 0;
        if (run->oversized > 0) {
            /* Give the memory back before waiting, and read what came during the reopen. */
            if (reopen(run) != 0)
                return 1;
            continue;
        }
        int lingering = written > 0 && run->linger_us > 0;
        written = 0;
        if (sync_wanted == 0) {
            r = lingering ? linger(run->j, run->linger_us) : wait_for_change(run->j, -1);
            if (r == -EPIPE)
                return 0;
            if (r < 0)
                return fail("Failed to wait for changes", r);
        } else if ((r = sd_journal_process(run->j)) < 0) {
            return fail("Failed to process journal changes", r);
        }
        /* A request that arrived before this pass begins is answered at its end. */
        syncing = sync_wanted;
        sync_wanted = 0;
    }
}

static int stream_last(Run *run) {
    /* The last entry of the journal, whatever its unit: where a tail start is pinned. */
    int r = sd_journal_previous(run->j);
    if (r < 0)
        return fail("Failed to iterate through journal", r);
    if (r > 0) {
        Selection all = run->sel;
        all.filter_units = 0;
        size_t oversized = 0; /* the program ends after this one entry */
        if ((r = write_entry(run->out, &run->entry, run->j, &all, &oversized)) < 0 ||
            (r = out_flush(run->out)) < 0)
            return fail("Failed to write entry", r);
    }
    return 0;
}

static const char USAGE[] =
    "usage: vllm-supervisor-journal-reader [--directory DIR] [--file PATH]... [--unit UNIT]...\n"
    "       [--field NAME]... [--follow] [--linger-ms MS] [--cursor CURSOR]\n"
    "       [--start head|tail|last] [--data-threshold BYTES] [--lines]\n";

static int usage_error(const char *message, const char *value) {
    fprintf(stderr, "%svllm-supervisor-journal-reader: error: %s%s%s\n", USAGE, message,
            value ? ": " : "", value ? value : "");
    return 2;
}

static int number(const char *text, long low, long high, long *value) {
    char *end;
    errno = 0;
    long n = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || n < low || n > high)
        return -1;
    *value = n;
    return 0;
}

/* The command line (built by the supervisor's `reader.native_argv`); 2 on a bad one. */
static int parse_options(int argc, char **argv, Options *o, Run *run) {
    enum { DIRECTORY = 1, FILE_, UNIT, FIELD, FOLLOW, CURSOR, START, THRESHOLD, LINGER, LINES };
    static const struct option longs[] = {
        {"directory", required_argument, NULL, DIRECTORY},
        {"file", required_argument, NULL, FILE_},
        {"unit", required_argument, NULL, UNIT},
        {"field", required_argument, NULL, FIELD},
        {"follow", no_argument, NULL, FOLLOW},
        {"cursor", required_argument, NULL, CURSOR},
        {"start", required_argument, NULL, START},
        {"data-threshold", required_argument, NULL, THRESHOLD},
        {"linger-ms", required_argument, NULL, LINGER},
        {"lines", no_argument, NULL, LINES},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        switch (c) {
        case DIRECTORY:
            o->directory = optarg;
            break;
        case FILE_:
            if (o->n_files >= MAX_FIELDS)
                return usage_error("too many --file", NULL);
            o->files[o->n_files++] = optarg;
            break;
        case UNIT:
            if (add_name(run->sel.units, &run->sel.n_units, optarg, "more than 64 --unit") != 0)
                return 2;
            break;
        case FIELD:
            if (add_name(run->sel.fields, &run->sel.n_fields, optarg, "more than 64 --field") != 0)
                return 2;
            break;
        case FOLLOW:
            run->follow = 1;
            break;
        case CURSOR:
            o->cursor = optarg;
            break;
        case START:
            if (strcmp(optarg, "head") != 0 && strcmp(optarg, "tail") != 0 &&
                strcmp(optarg, "last") != 0)
                return usage_error("--start must be head, tail or last", optarg);
            o->start = optarg;
            break;
        case THRESHOLD:
            if (number(optarg, 0, LONG_MAX, &o->data_threshold) < 0)
                return usage_error("--data-threshold must be a number of bytes", optarg);
            break;
        case LINGER:
            if (number(optarg, 0, 1000, &o->linger_ms) < 0)
                return usage_error("--linger-ms must be within 0..1000", optarg);
            break;
        case LINES:
            run->sel.lines = 1;
            break;
        default: {
            /* A rejected short option leaves optind on its word, a long one moves past it. */
            char flag[3] = {'-', (char)optopt, '\0'};
            int is_short = optopt > LINES; /* long options report their value, 1..LINES */
            return usage_error("unknown or incomplete option", is_short ? flag : argv[optind - 1]);
        }
        }
    }
    if (optind < argc)
        return usage_error("unexpected argument", argv[optind]);
    return 0;
}

int main(int argc, char **argv) {
    static Out out;
    if (argc < 1)
        return usage_error("no program name", NULL);
    /* A reader that went away is an end, not a crash: writes then fail with EPIPE, which every
     * write path turns into exit 0 (the interpreter that used to run this ignored it too). */
    signal(SIGPIPE, SIG_IGN);
    Options o = {.start = "head"};
    Run run = {.out = &out, .options = &o, .entry = {NULL, 0, 0}};
    int status = parse_options(argc, argv, &o, &run);
    if (status != 0)
        return status;
    (void)mallopt(M_MMAP_THRESHOLD, OWN_PAGES_FROM);
    run.linger_us = (uint64_t)o.linger_ms * 1000;
    run.sel.max_value = (size_t)o.data_threshold;
    /* Following: match the units on the fields read, not with sd_journal_add_match (what
     * journalctl --unit --follow does, and misses units that had no entry yet on 252). */
    run.sel.filter_units = run.follow && run.sel.n_units > 0;
    run.sel.message = -1;
    for (size_t i = 0; i < run.sel.n_fields; i++)
        if (run.sel.fields[i].len == 7 && memcmp(run.sel.fields[i].name, "MESSAGE", 7) == 0)
            run.sel.message = (int)i;
    /* The supervisor may die without closing us (kill -9): do not outlive it. */
    pid_t parent = getppid();
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent)
        return 0; /* it died before the line above took effect */
    /* A pipe holds 64 KiB by default: the reader would stop every 64 KiB to wait for the parent.
     * With OUT_SIZE it can run a whole buffer ahead (best effort: a plain file is fine too). */
    (void)fcntl(STDOUT_FILENO, F_SETPIPE_SZ, OUT_SIZE);
    status = open_selected(&run);
    if (status == 0)
        status = position(run.j, o.cursor, o.start);
    if (status == 0)
        status = strcmp(o.start, "last") == 0 && o.cursor == NULL
                     ? stream_last(&run)
                     : stream_loop(&run, o.cursor != NULL);
    if (run.j != NULL)
        sd_journal_close(run.j);
    free(run.entry.data);
    return status;
}
