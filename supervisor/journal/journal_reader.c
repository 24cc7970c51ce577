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
 *
 * Units: any number, given with --unit or, without a limit of the command line's length, one
 * a line on stdin (--units-from-stdin) ahead of the sync requests. A following child catches
 * up first through libsystemd's matches on the units' fields, which use the journal's field
 * index: a backlog costs what the units' share of it costs (as `journalctl -u` does), not a
 * look at every entry. Then it follows on every entry's fields (see catch_up).
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
/* While a pass reads, what it wrote is handed over at least this often (checked every
 * FLUSH_CHECK_EVERY entries), so that a long backlog's first entries reach the parent (and its
 * first decisions are made) while the rest is still being read. */
#define FLUSH_EVERY_US 50000
#define FLUSH_CHECK_EVERY 1024
/* libsystemd's matches cost, for each entry they return, an index look-up per unit and field
 * (sd-journal's next_for_match tries every term of an OR), where matching an entry's own fields
 * against a hash set of the units costs the same for any number of units, but is paid for every
 * entry. Measured here (systemd 252): a look-up costs about a quarter of looking at an entry. So
 * the matches are used up to MATCH_UNITS_MAX units, and a pass through them goes on looking at
 * every entry instead once, over MATCH_CHECK_EVERY entries returned, entries returned times
 * units exceed MATCH_DENSITY_MAX times the entries they span (seqnums): e.g. 64 units that are
 * 13 % of the journal, or 8 that are all of it. 500 units that are all of a journal took 128 s
 * through the matches, 1.5 s entry by entry; 1 unit that is 1 % of it, 25x less than entry by
 * entry. */
#define MATCH_UNITS_MAX 64
#define MATCH_CHECK_EVERY 1024
#define MATCH_DENSITY_MAX 2
/* A unit name read from stdin longer than this is refused (systemd's own limit is 256). */
#define MAX_UNIT_NAME 4096
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

/* The units: a growing array of names, indexed by an open-addressing hash table, so that an
 * entry's unit field is looked up at the same cost whatever the number of units. */
typedef struct {
    Name *items;
    size_t count, cap;
    size_t *slots;  /* index + 1 into items; 0: empty */
    size_t n_slots; /* a power of two, at least twice count */
} NameSet;

static uint64_t hash_bytes(const char *data, size_t size) {
    uint64_t h = 14695981039346656037ull; /* FNV-1a */
    for (size_t i = 0; i < size; i++)
        h = (h ^ (unsigned char)data[i]) * 1099511628211ull;
    return h;
}

/* 1 when `name` is in the set (*slot: where), else 0 (*slot: the free slot it would take). */
static int nameset_find(const NameSet *set, const char *name, size_t len, size_t *slot) {
    if (set->n_slots == 0)
        return 0;
    size_t mask = set->n_slots - 1;
    for (size_t i = hash_bytes(name, len) & mask;; i = (i + 1) & mask) {
        size_t at = set->slots[i];
        *slot = i;
        if (at == 0)
            return 0;
        const Name *item = &set->items[at - 1];
        if (item->len == len && memcmp(item->name, name, len) == 0)
            return 1;
    }
}

static int nameset_has(const NameSet *set, const char *name, size_t len) {
    size_t slot;
    return nameset_find(set, name, len, &slot);
}

static int nameset_rehash(NameSet *set, size_t n_slots) {
    size_t *slots = calloc(n_slots, sizeof *slots);
    if (slots == NULL)
        return -ENOMEM;
    free(set->slots);
    set->slots = slots;
    set->n_slots = n_slots;
    for (size_t k = 0; k < set->count; k++) {
        size_t slot;
        (void)nameset_find(set, set->items[k].name, set->items[k].len, &slot);
        set->slots[slot] = k + 1;
    }
    return 0;
}

/* Add a copy of `name` (a repeated one is kept once); 0, or -ENOMEM. */
static int nameset_add(NameSet *set, const char *name, size_t len) {
    if (nameset_has(set, name, len))
        return 0;
    if (set->count == set->cap) {
        size_t cap = set->cap ? set->cap * 2 : 16;
        Name *items = realloc(set->items, cap * sizeof *items);
        if (items == NULL)
            return -ENOMEM;
        set->items = items;
        set->cap = cap;
    }
    if (2 * (set->count + 1) > set->n_slots) {
        int r = nameset_rehash(set, set->n_slots ? set->n_slots * 2 : 64);
        if (r < 0)
            return r;
    }
    char *copy = malloc(len + 1);
    if (copy == NULL)
        return -ENOMEM;
    memcpy(copy, name, len);
    copy[len] = '\0';
    size_t slot;
    (void)nameset_find(set, copy, len, &slot);
    set->items[set->count++] = (Name){copy, len};
    set->slots[slot] = set->count;
    return 0;
}

static void nameset_free(NameSet *set) {
    for (size_t k = 0; k < set->count; k++)
        free((char *)set->items[k].name);
    free(set->items);
    free(set->slots);
}

/* The fields that name the unit an entry is of or about: what `journalctl --unit` looks at. */
static const char *const UNIT_FIELDS[] = {"_SYSTEMD_UNIT", "UNIT", "OBJECT_SYSTEMD_UNIT"};
#define N_UNIT_FIELDS (sizeof UNIT_FIELDS / sizeof UNIT_FIELDS[0])

static int is_unit_field(const char *name, size_t len) {
    for (size_t f = 0; f < N_UNIT_FIELDS; f++)
        if (strlen(UNIT_FIELDS[f]) == len && memcmp(UNIT_FIELDS[f], name, len) == 0)
            return 1;
    return 0;
}

typedef struct {
    Name fields[MAX_FIELDS];
    size_t n_fields;
    char unit_field[MAX_FIELDS]; /* 1 where fields[i] names a unit (UNIT_FIELDS) */
    NameSet units;
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
        if (!matched && sel->unit_field[index] &&
            nameset_has(&sel->units, (const char *)data + name_len + 1, size - name_len - 1))
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

static void take_sync_requests(const char *buf, size_t n) {
    for (size_t i = 0; i < n; i++) {
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

static void read_sync_requests(void) {
    char buf[256];
    ssize_t n = read(sync_fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        sync_fd = -1; /* closed, or not a pipe: no more requests */
        return;
    }
    if (n > 0)
        take_sync_requests(buf, (size_t)n);
}

/* --units-from-stdin: the parent writes the unit names one a line, then an empty line, then
 * (following) its sync requests. What follows the empty line in the last read goes to the sync
 * requests. End of input also ends the list. 0; -ENOMEM; -EINVAL for a name over MAX_UNIT_NAME
 * bytes (named in *bad, cut). */
static int read_units(NameSet *units, char *bad, size_t bad_size) {
    char buf[65536];
    Buf line = {NULL, 0, 0};
    int r = 0, done = 0;
    while (!done) {
        ssize_t n = read(STDIN_FILENO, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) { /* the end (or no stdin): a last name without its newline counts too */
            if (line.len > 0)
                r = nameset_add(units, line.data, line.len);
            sync_fd = -1;
            break;
        }
        for (ssize_t i = 0; i < n && r >= 0; i++) {
            if (buf[i] != '\n') {
                if (line.len >= MAX_UNIT_NAME) {
                    snprintf(bad, bad_size, "%.*s", 64, line.data);
                    r = -EINVAL;
                    break;
                }
                r = buf_put(&line, &buf[i], 1);
                continue;
            }
            if (line.len == 0) { /* the list's end */
                take_sync_requests(buf + i + 1, (size_t)(n - i - 1));
                done = 1;
                break;
            }
            r = nameset_add(units, line.data, line.len);
            line.len = 0;
        }
        if (r < 0)
            break;
    }
    free(line.data);
    return r;
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

static int add_field(Selection *sel, const char *name) {
    if (sel->n_fields >= MAX_FIELDS)
        return usage_error("more than 64 --field", name);
    size_t len = strlen(name);
    sel->unit_field[sel->n_fields] = (char)is_unit_field(name, len);
    sel->fields[sel->n_fields++] = (Name){name, len};
    return 0;
}

/* `FIELD=u1 OR FIELD=u2 ...` for each of UNIT_FIELDS, the three ORed: what the follower's own
 * match on the fields accepts (`nameset_has` in write_entry), so that a catch-up through the
 * index hands over exactly what following would. (`journalctl --unit` also requires _PID=1 with
 * UNIT= and _UID=0 with OBJECT_SYSTEMD_UNIT=: the parent trusts those fields only from such
 * senders anyway, see export.decode.) */
static int add_unit_matches(sd_journal *j, const NameSet *units) {
    Buf match = {NULL, 0, 0};
    int r = 0;
    for (size_t f = 0; f < N_UNIT_FIELDS && r >= 0; f++) {
        if (f > 0 && (r = sd_journal_add_disjunction(j)) < 0)
            break;
        for (size_t i = 0; i < units->count && r >= 0; i++) {
            match.len = 0;
            if ((r = buf_put(&match, UNIT_FIELDS[f], strlen(UNIT_FIELDS[f]))) < 0 ||
                (r = buf_put(&match, "=", 1)) < 0 ||
                (r = buf_put(&match, units->items[i].name, units->items[i].len)) < 0)
                break;
            r = sd_journal_add_match(j, match.data, match.len);
        }
    }
    free(match.data);
    return r < 0 ? r : 0;
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
    int units_from_stdin;
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
    int matching; /* the unit matches are on the journal (reading once, or catching up) */
    uint64_t linger_us;
    uint64_t flushed_us; /* when the output was last handed over (CLOCK_MONOTONIC) */
    char checked_id[33]; /* where matches_pay last looked: seqnum id and seqnum */
    unsigned long long checked_seqnum;
    size_t oversized; /* bytes of fields over the data threshold read since the journal opened */
} Run;

static uint64_t now_us(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000 + (uint64_t)now.tv_nsec / 1000;
}

/* Open the journal the options name, as selected: the data threshold, the unit matches while
 * `matching`; when following, its inotify watch at once, so that no change after the open is
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
    if (run->matching && (r = add_unit_matches(run->j, &run->sel.units)) < 0)
        return fail("Failed to add unit matches", r);
    if (run->follow && (r = sd_journal_get_fd(run->j)) < 0)
        return fail("Failed to watch journal", r);
    run->oversized = 0;
    return 0;
}

/* Put the unit matches on or off the open journal (its position is then lost: seek after). */
static int set_matching(Run *run, int matching) {
    int r = 0;
    sd_journal_flush_matches(run->j);
    run->matching = matching;
    if (matching && (r = add_unit_matches(run->j, &run->sel.units)) < 0)
        return fail("Failed to add unit matches", r);
    return 0;
}

/* Position the journal so that the next sd_journal_next() returns the first entry (as matched)
 * after the one of `cursor`: on that entry, or if it went away (vacuumed) or does not match,
 * before the first entry after it. <0 on failure. */
static int seek_past(sd_journal *j, const char *cursor) {
    int r = sd_journal_seek_cursor(j, cursor);
    if (r >= 0 && (r = sd_journal_next(j)) > 0 && (r = sd_journal_test_cursor(j, cursor)) == 0) {
        /* On the entry after it: step back, so that it is the next one read. */
        r = sd_journal_previous(j);
        if (r == 0) /* nothing before it: it is the journal's first entry */
            r = sd_journal_seek_head(j);
    }
    return r < 0 ? r : 0;
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
    if (status == 0 && (r = seek_past(run->j, cursor)) < 0)
        status = fail("Failed to reopen journal", r);
    free(cursor);
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

static int flush_output(Run *run) {
    run->flushed_us = now_us();
    return out_flush(run->out);
}

enum { PASS_END = 0, PASS_FAILED = 1, PASS_GONE = 2, PASS_SCAN = 3 };

/* The seqnum id and seqnum of the current entry, from its cursor ("s=ID;i=HEX;..."); 0 when
 * it cannot be read. */
static int current_seqnum(sd_journal *j, char id[33], unsigned long long *seqnum) {
    char *cursor = NULL;
    if (sd_journal_get_cursor(j, &cursor) < 0)
        return 0;
    const char *i = strstr(cursor, ";i=");
    int ok = strncmp(cursor, "s=", 2) == 0 && i != NULL && i - cursor - 2 <= 32;
    if (ok) {
        memcpy(id, cursor + 2, (size_t)(i - cursor - 2));
        id[i - cursor - 2] = '\0';
        *seqnum = strtoull(i + 3, NULL, 16);
    }
    free(cursor);
    return ok;
}

/* Are the matches still cheaper than looking at every entry (see MATCH_DENSITY_MAX)? Called
 * every MATCH_CHECK_EVERY entries a matched pass returned: compares the seqnums spanned since
 * the last call, within one seqnum id. */
static int matches_pay(Run *run) {
    char id[33];
    unsigned long long seqnum;
    if (!current_seqnum(run->j, id, &seqnum))
        return 1;
    int same = strcmp(id, run->checked_id) == 0 && seqnum > run->checked_seqnum;
    unsigned long long spanned = seqnum - run->checked_seqnum;
    memcpy(run->checked_id, id, sizeof id);
    run->checked_seqnum = seqnum;
    return !same || (unsigned long long)MATCH_CHECK_EVERY * run->sel.units.count <=
                        (unsigned long long)MATCH_DENSITY_MAX * spanned;
}

/* Take the matches off and go on after the current entry, looking at each. PASS_END, or
 * PASS_FAILED with a message. */
static int stop_matching(Run *run) {
    char *cursor = NULL;
    int r = sd_journal_get_cursor(run->j, &cursor);
    if (r < 0)
        return fail("Failed to get cursor", r);
    run->sel.filter_units = 1;
    (void)set_matching(run, 0); /* only flushes the matches */
    r = seek_past(run->j, cursor);
    free(cursor);
    return r < 0 ? fail("Failed to seek", r) : PASS_END;
}

/* Read from the journal's position to its end, writing each entry about the units. Entries of
 * other units are summarised by cursor-only records (at the end, and every
 * SKIPPED_CURSOR_EVERY of them; with `*first_is_cursor`, the first entry read is always
 * reported). Adds to *written the records written and to *read the entries read.
 * PASS_END, PASS_FAILED (a message was printed), PASS_GONE (the parent went away) or, with the
 * matches on, PASS_SCAN: they cost more than looking at each entry (see matches_pay). */
static int read_pass(Run *run, int *first_is_cursor, long *written, long *read) {
    long skipped = 0; /* entries of other units since the last record written */
    long since_check = 0;
    int r;
    for (;;) {
        r = sd_journal_next(run->j);
        if (r < 0)
            return fail("Failed to iterate through journal", r);
        if (r == 0)
            break;
        (*read)++;
        r = write_entry(run->out, &run->entry, run->j, &run->sel, &run->oversized);
        /* The entry a cursor seek lands on is always reported, if only by its cursor, so the
         * parent sees whether the saved entry is still there. */
        long every = *first_is_cursor ? 1 : SKIPPED_CURSOR_EVERY;
        *first_is_cursor = 0;
        if (r == 0 && ++skipped >= every && (r = cursor_record(run)) >= 0)
            skipped = 0, (*written)++;
        else if (r > 0)
            skipped = 0, (*written)++;
        if (r >= 0 && ++since_check >= FLUSH_CHECK_EVERY) {
            since_check = 0;
            if (run->out->len > 0 && now_us() - run->flushed_us >= FLUSH_EVERY_US)
                r = flush_output(run);
        }
        if (r < 0)
            return r == -EPIPE ? PASS_GONE : fail("Failed to write entry", r);
        if (run->oversized >= REOPEN_AFTER_BYTES && reopen(run) != 0)
            return PASS_FAILED;
        if (run->matching && *read % MATCH_CHECK_EVERY == 0 && !matches_pay(run))
            return PASS_SCAN; /* the entries after this one are read without the matches */
    }
    if (skipped > 0 && (r = cursor_record(run)) < 0)
        return r == -EPIPE ? PASS_GONE : fail("Failed to write entry", r);
    *written += skipped > 0;
    return PASS_END;
}

/* The last entry of the whole journal (the matches off), as a cursor in *tail, NULL when the
 * journal is empty; the position is lost. 0, or 1 with a message. */
static int pin_tail(Run *run, char **tail) {
    free(*tail);
    *tail = NULL;
    int r;
    if (set_matching(run, 0) != 0)
        return 1;
    if ((r = sd_journal_seek_tail(run->j)) < 0 || (r = sd_journal_previous(run->j)) < 0 ||
        (r > 0 && (r = sd_journal_get_cursor(run->j, tail)) < 0))
        return fail("Failed to seek to tail", r);
    return 0;
}

/* Before following: read what is already in the journal through the unit matches, which use the
 * journal's field index (what `journalctl --unit` does), instead of looking at every entry.
 *
 * On systemd 252 a journal followed with matches misses units that had no entry yet (see
 * `native_argv`), so the matches serve only up to the tail, then come off. The tail is pinned
 * once a matched pass has reached the end, and another matched pass reads what came meanwhile;
 * when one finds nothing new, every matching entry up to the pinned tail has been handed over
 * and none after it. Following then goes on after the tail, whose cursor moves the parent's
 * checkpoint. `*first_is_cursor`: the first entry read is reported (a cursor start), before the
 * matches go on. Ends positioned for stream_loop. PASS_END, PASS_FAILED or PASS_GONE. */
static int catch_up(Run *run, int *first_is_cursor) {
    long written = 0, read = 0;
    char *from = NULL; /* the last entry read (or the start); NULL: the head */
    char *tail = NULL;
    int status = PASS_END, r;
    if (*first_is_cursor) {
        /* The entry the cursor seek lands on is reported (unmatched, as in stream_loop); the
         * catch-up goes on after it. With none there, the first entry that comes is. */
        r = sd_journal_next(run->j);
        if (r < 0)
            return fail("Failed to iterate through journal", r);
        if (r > 0) {
            *first_is_cursor = 0;
            r = write_entry(run->out, &run->entry, run->j, &run->sel, &run->oversized);
            if (r == 0)
                r = cursor_record(run);
            if (r >= 0)
                r = sd_journal_get_cursor(run->j, &from);
            if (r < 0)
                return r == -EPIPE ? PASS_GONE : fail("Failed to write entry", r);
        } else if ((from = strdup(run->options->cursor)) == NULL) {
            return fail("Failed to allocate", -ENOMEM);
        }
    } else if (strcmp(run->options->start, "head") != 0 &&
               sd_journal_get_cursor(run->j, &from) < 0) {
        from = NULL; /* a tail start on an empty journal */
    }
    while (status == PASS_END) {
        read = 0;
        if (set_matching(run, 1) != 0) {
            status = PASS_FAILED;
            break;
        }
        r = from != NULL ? seek_past(run->j, from) : sd_journal_seek_head(run->j);
        if (r < 0) {
            status = fail("Failed to seek", r);
            break;
        }
        int first = 0;
        status = read_pass(run, &first, &written, &read);
        if (status == PASS_SCAN) { /* the rest of the backlog entry by entry, then following */
            free(from);
            free(tail);
            return stop_matching(run);
        }
        if (status != PASS_END)
            break;
        if (read > 0) {
            free(from);
            from = NULL;
            if ((r = sd_journal_get_cursor(run->j, &from)) < 0) {
                status = fail("Failed to get cursor", r);
                break;
            }
        } else if (tail != NULL) {
            break; /* nothing came after `from` since the tail was pinned */
        }
        if (pin_tail(run, &tail) != 0)
            status = PASS_FAILED;
        else if (tail == NULL)
            break; /* an empty journal */
    }
    free(from);
    if (status == PASS_END && set_matching(run, 0) != 0)
        status = PASS_FAILED;
    if (status == PASS_END) {
        r = tail != NULL ? seek_past(run->j, tail) : sd_journal_seek_head(run->j);
        if (r < 0)
            status = fail("Failed to seek", r);
        /* The tail's cursor moves the checkpoint past the entries of other units before it
         * (unless a cursor start found nothing yet to report: the first entry to come is). */
        else if (tail != NULL && !*first_is_cursor && sd_journal_test_cursor(run->j, tail) > 0 &&
                 (r = cursor_record(run)) < 0)
            status = r == -EPIPE ? PASS_GONE : fail("Failed to write", r);
    }
    free(tail);
    return status;
}

static int stream_loop(Run *run, int first_is_cursor) {
    long written = 0; /* records written since the last wait */
    long read = 0;
    long long syncing = 0; /* the request this pass answers when it reaches the end */
    int r;
    for (;;) {
        int status = read_pass(run, &first_is_cursor, &written, &read);
        if (status == PASS_SCAN && (status = stop_matching(run)) == PASS_END)
            continue; /* reading once: the rest entry by entry */
        if (status != PASS_END)
            return status == PASS_GONE ? 0 : status;
        if (syncing > 0 && (r = write_sync(run->out, syncing)) < 0)
            return r == -EPIPE ? 0 : fail("Failed to write", r);
        syncing = 0;
        if ((r = flush_output(run)) < 0)
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
    "       [--units-from-stdin] [--field NAME]... [--follow] [--linger-ms MS] [--cursor CURSOR]\n"
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
    enum {
        DIRECTORY = 1,
        FILE_,
        UNIT,
        UNITS_FROM_STDIN,
        FIELD,
        FOLLOW,
        CURSOR,
        START,
        THRESHOLD,
        LINGER,
        LINES
    };
    static const struct option longs[] = {
        {"directory", required_argument, NULL, DIRECTORY},
        {"file", required_argument, NULL, FILE_},
        {"unit", required_argument, NULL, UNIT},
        {"units-from-stdin", no_argument, NULL, UNITS_FROM_STDIN},
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
            if (nameset_add(&run->sel.units, optarg, strlen(optarg)) < 0)
                return usage_error("out of memory for --unit", optarg);
            break;
        case UNITS_FROM_STDIN:
            o->units_from_stdin = 1;
            break;
        case FIELD:
            if (add_field(&run->sel, optarg) != 0)
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
    char bad[80];
    int r;
    if (status == 0 && o.units_from_stdin &&
        (r = read_units(&run.sel.units, bad, sizeof bad)) < 0)
        status = r == -EINVAL ? usage_error("a unit name on stdin is too long", bad)
                              : usage_error("out of memory for the units on stdin", NULL);
    if (status != 0) {
        nameset_free(&run.sel.units);
        return status;
    }
    (void)mallopt(M_MMAP_THRESHOLD, OWN_PAGES_FROM);
    run.linger_us = (uint64_t)o.linger_ms * 1000;
    run.sel.max_value = (size_t)o.data_threshold;
    size_t n_units = run.sel.units.count;
    /* Reading once, the units' matches select the entries, up to MATCH_UNITS_MAX units.
     * Following, each entry's unit fields are matched here, not with sd_journal_add_match (what
     * journalctl --unit --follow does, and misses units that had no entry yet on 252); the
     * catch-up before it uses the matches (see catch_up). */
    int use_matches = n_units > 0 && n_units <= MATCH_UNITS_MAX;
    run.matching = use_matches && !run.follow;
    run.sel.filter_units = n_units > 0 && !run.matching;
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
    int first_is_cursor = o.cursor != NULL;
    if (status == 0 && strcmp(o.start, "last") == 0 && o.cursor == NULL) {
        status = stream_last(&run);
    } else if (status == 0) {
        if (run.follow && use_matches) {
            run.flushed_us = now_us();
            status = catch_up(&run, &first_is_cursor);
        }
        status = status == PASS_END    ? stream_loop(&run, first_is_cursor)
                 : status == PASS_GONE ? 0
                                       : status;
    }
    if (run.j != NULL)
        sd_journal_close(run.j);
    free(run.entry.data);
    nameset_free(&run.sel.units);
    return status;
}
