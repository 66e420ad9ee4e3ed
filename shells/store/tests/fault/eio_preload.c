/*
 * A fault-injecting file layer for the store's tests, loaded with
 * LD_PRELOAD into a child process: reads of one chosen open of one file
 * fail with EIO, as a failing disk makes them.
 *
 *   RVBOX_FAULT_PATH   the path suffix of the file (e.g. "/rvbox.sqlite3")
 *   RVBOX_FAULT_OPEN   the first open of that file that is faulty (1 = the
 *                      first; every later one is faulty too)
 *   RVBOX_FAULT_READS  how many reads of the faulty descriptors fail, in
 *                      all (-1: every one)
 *
 * Only read(2), pread(2) and pread64 on those descriptors are touched;
 * every other call goes to libc unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
#define MAX_FAULTY 64
static int opens = 0;
static int faulty[MAX_FAULTY];
static int nfaulty = 0;
static long remaining = 0;
static int armed = 0;

static int is_faulty(int fd) {
    for (int i = 0; i < nfaulty; i++) if (faulty[i] == fd) return 1;
    return 0;
}

static int matches(const char *path) {
    const char *want = getenv("RVBOX_FAULT_PATH");
    if (!want || !path) return 0;
    size_t n = strlen(path), w = strlen(want);
    return n >= w && strcmp(path + n - w, want) == 0;
}

static void opened(const char *path, int fd) {
    if (fd < 0 || !matches(path)) return;
    const char *which = getenv("RVBOX_FAULT_OPEN");
    const char *reads = getenv("RVBOX_FAULT_READS");
    pthread_mutex_lock(&lock);
    opens++;
    if (which && opens >= atoi(which) && nfaulty < MAX_FAULTY) {
        faulty[nfaulty++] = fd;
        if (!armed) { remaining = reads ? atol(reads) : -1; armed = 1; }
    }
    pthread_mutex_unlock(&lock);
}

static int fail_now(int fd) {
    int fail = 0;
    pthread_mutex_lock(&lock);
    if (is_faulty(fd) && remaining != 0) {
        fail = 1;
        if (remaining > 0) remaining--;
    }
    pthread_mutex_unlock(&lock);
    return fail;
}

#define NEXT(name) static __typeof__(name) *next; if (!next) next = dlsym(RTLD_NEXT, #name)

int open(const char *path, int flags, ...) {
    NEXT(open);
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
    int fd = next(path, flags, mode);
    opened(path, fd);
    return fd;
}

int open64(const char *path, int flags, ...) {
    NEXT(open64);
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
    int fd = next(path, flags, mode);
    opened(path, fd);
    return fd;
}

int openat(int dir, const char *path, int flags, ...) {
    NEXT(openat);
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) { va_list a; va_start(a, flags); mode = va_arg(a, mode_t); va_end(a); }
    int fd = next(dir, path, flags, mode);
    opened(path, fd);
    return fd;
}

int close(int fd) {
    NEXT(close);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nfaulty; i++) if (faulty[i] == fd) faulty[i] = faulty[--nfaulty];
    pthread_mutex_unlock(&lock);
    return next(fd);
}

ssize_t read(int fd, void *buf, size_t n) {
    NEXT(read);
    if (fail_now(fd)) { errno = EIO; return -1; }
    return next(fd, buf, n);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) {
    NEXT(pread);
    if (fail_now(fd)) { errno = EIO; return -1; }
    return next(fd, buf, n, off);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off) {
    NEXT(pread64);
    if (fail_now(fd)) { errno = EIO; return -1; }
    return next(fd, buf, n, off);
}
