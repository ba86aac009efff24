/* Copy runs between mapped memory in one call, the GIL released, large runs streamed.
 *
 * Rules (memruns.py holds the Python side and the fallback when this is not built):
 * - Runs are raw addresses, as the copy planner makes them: the caller guarantees the
 *   memory stays mapped while they run. Nothing here checks addresses.
 * - A run of at least ``stream_min_bytes`` is written with non-temporal stores (x86-64):
 *   a KV page goes to memory without first reading its destination into the cache,
 *   which doubles the memory traffic of a plain copy. glibc streams only copies near
 *   the L3 size and, on some CPUs, never below a few hundred KiB; KV pages are 16 KiB
 *   to 2 MiB. Smaller runs, and every run elsewhere, are memcpy.
 * - Overlapping source and destination are memmove'd (never streamed).
 * - Every streamed store is fenced before the call returns: whoever is told a copy is
 *   done sees its bytes.
 * - ``copy_runs_guarded`` survives memory that vanishes under it (a memfd its owner
 *   shrank): a SIGBUS or SIGSEGV that the copying thread's own access raised while it
 *   copies (si_code > 0: from the kernel, never a kill) jumps back out of the copy,
 *   which returns False. The handler is installed on first use (and again if something
 *   replaced it); any other fault or signal goes to whatever handler was there before
 *   (by default: the process dies, as it would have), and one that comes back to ours
 *   from there ends the process. The guard is a thread-local pointer of the
 *   initial-exec model, so the handler reads it without allocating.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVO_STREAMS 1
#else
#define KVO_STREAMS 0
#endif

static void copy_one(char *dst, const char *src, size_t n, size_t stream_min) {
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d < s + n && s < d + n) {
        memmove(dst, src, n);
        return;
    }
#if KVO_STREAMS
    if (n >= stream_min && n >= 64) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            src += 64;
            dst += 64;
            n -= 64;
        }
    }
#else
    (void)stream_min;
#endif
    memcpy(dst, src, n);
}

static void fence(void) {
#if KVO_STREAMS
    _mm_sfence();
#endif
}

/* Set while this thread runs a guarded copy; volatile, so the stores around the copy
 * are never dropped or moved across it. */
static __thread sigjmp_buf *volatile guard __attribute__((tls_model("initial-exec")));
/* Set while this thread's handler runs the previous one: a previous handler that hands
 * the signal back (Python's faulthandler re-raises it) ends the process, not a loop. */
static __thread volatile int chaining __attribute__((tls_model("initial-exec")));
static struct sigaction previous[2]; /* SIGBUS, SIGSEGV as they were before ours */
static const int guarded_signals[2] = {SIGBUS, SIGSEGV};

static void die_of(int sig) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(sig, &dfl, NULL);
    raise(sig); /* not blocked (SA_NODEFER): delivered, and the default ends the process */
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *g = guard;
    /* only a fault the copy itself took (si_code > 0: from the kernel, not a kill) */
    if (g != NULL && info != NULL && info->si_code > 0)
        siglongjmp(*g, 1);
    if (chaining) {
        die_of(sig);
        return;
    }
    const struct sigaction *was = &previous[sig == SIGBUS ? 0 : 1];
    chaining = 1;
    if (was->sa_flags & SA_SIGINFO) {
        was->sa_sigaction(sig, info, context);
    } else if (was->sa_handler == SIG_IGN && info != NULL && info->si_code <= 0) {
        /* a signal sent to an ignoring process: ignored, as before */
    } else if (was->sa_handler == SIG_DFL || was->sa_handler == SIG_IGN) {
        die_of(sig);
    } else {
        was->sa_handler(sig);
    }
    chaining = 0;
}

/* Ours in place for both signals (called with the GIL held: one thread at a time). */
static int install_fault_handler(void) {
    for (int i = 0; i < 2; i++) {
        struct sigaction now;
        if (sigaction(guarded_signals[i], NULL, &now) < 0)
            goto fail;
        if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault)
            continue;
        struct sigaction ours;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_fault;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        if (sigaction(guarded_signals[i], &ours, &previous[i]) < 0)
            goto fail;
    }
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* The buffers as int64 vectors of one length; 0 on success, -1 with an exception. */
static int int64_vectors(PyObject *const *args, Py_buffer *views, int count, Py_ssize_t *len) {
    int i;
    for (i = 0; i < count; i++) {
        if (PyObject_GetBuffer(args[i], &views[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto fail;
        const char *f = views[i].format ? views[i].format : "B";
#if PY_LITTLE_ENDIAN
        if (*f == '<')
            f++;
#endif
        if (*f == '=' || *f == '@')
            f++;
        if (views[i].itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
            PyErr_Format(PyExc_TypeError, "argument %d is not a vector of int64", i + 1);
            i++;
            goto fail;
        }
        if (i && views[i].len != views[0].len) {
            PyErr_SetString(PyExc_ValueError, "the vectors differ in length");
            i++;
            goto fail;
        }
    }
    *len = views[0].len / 8;
    return 0;
fail:
    while (i-- > 0)
        PyBuffer_Release(&views[i]);
    return -1;
}

static void release_views(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
}

static int nonnegative(const int64_t *v, Py_ssize_t len, const char *what) {
    for (Py_ssize_t i = 0; i < len; i++)
        if (v[i] < 0) {
            PyErr_Format(PyExc_ValueError, "negative %s at %zd", what, i);
            return -1;
        }
    return 0;
}

static int stream_min_of(PyObject *arg, size_t *out) {
    Py_ssize_t v = PyLong_AsSsize_t(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "stream_min_bytes is negative");
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

/* copy_runs' and copy_runs_guarded's arguments: three int64 vectors of one length and
 * non-negative run lengths, then stream_min_bytes. 0 with the views held (release them
 * with release_views), -1 with an exception and nothing held. */
static int run_arguments(PyObject *const *args, Py_ssize_t nargs, const char *name,
                         Py_buffer *v, Py_ssize_t *len, size_t *stream_min) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s takes dst, src, nbytes, stream_min_bytes", name);
        return -1;
    }
    if (stream_min_of(args[3], stream_min) < 0 || int64_vectors(args, v, 3, len) < 0)
        return -1;
    if (nonnegative(v[2].buf, *len, "run length") < 0) {
        release_views(v, 3);
        return -1;
    }
    return 0;
}

/* Copy the runs (call without the GIL); the caller fences. */
static void copy_run_list(const Py_buffer *v, Py_ssize_t len, size_t stream_min) {
    const int64_t *dst = v[0].buf, *src = v[1].buf, *n = v[2].buf;
    for (Py_ssize_t i = 0; i < len; i++)
        copy_one((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], (size_t)n[i],
                 stream_min);
}

PyDoc_STRVAR(copy_runs_doc,
"copy_runs(dst, src, nbytes, stream_min_bytes)\n\n"
"Copy nbytes[i] bytes from address src[i] to dst[i] for every i (int64 vectors).");

static PyObject *copy_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[3];
    Py_ssize_t len;
    size_t stream_min;
    if (run_arguments(args, nargs, "copy_runs", v, &len, &stream_min) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    copy_run_list(v, len, stream_min);
    fence();
    Py_END_ALLOW_THREADS
    release_views(v, 3);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_runs_guarded_doc,
"copy_runs_guarded(dst, src, nbytes, stream_min_bytes) -> bool\n\n"
"copy_runs, but False where memory vanished under the copy (SIGBUS, SIGSEGV on this\n"
"thread while it copied): the runs before the fault are copied, the rest not.");

static PyObject *copy_runs_guarded(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[3];
    Py_ssize_t len;
    size_t stream_min;
    if (install_fault_handler() < 0 ||
        run_arguments(args, nargs, "copy_runs_guarded", v, &len, &stream_min) < 0)
        return NULL;
    volatile int faulted = 0;
    Py_BEGIN_ALLOW_THREADS
    sigjmp_buf env;
    if (sigsetjmp(env, 1) == 0) {
        guard = &env;
        copy_run_list(v, len, stream_min);
    } else {
        faulted = 1;
    }
    guard = NULL;
    fence();
    Py_END_ALLOW_THREADS
    release_views(v, 3);
    return PyBool_FromLong(!faulted);
}

PyDoc_STRVAR(copy_groups_doc,
"copy_groups(dst, src, nbytes, rows, dst_step, src_step, stream_min_bytes)\n\n"
"For every group i, copy rows[i] rows of nbytes[i] bytes: row r from\n"
"src[i] + r * src_step[i] to dst[i] + r * dst_step[i] (int64 vectors).");

static PyObject *copy_groups(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[6];
    Py_ssize_t len;
    size_t stream_min;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_groups takes dst, src, nbytes, rows, dst_step, src_step, "
                        "stream_min_bytes");
        return NULL;
    }
    if (stream_min_of(args[6], &stream_min) < 0 || int64_vectors(args, v, 6, &len) < 0)
        return NULL;
    const int64_t *dst = v[0].buf, *src = v[1].buf, *n = v[2].buf, *rows = v[3].buf;
    const int64_t *dstep = v[4].buf, *sstep = v[5].buf;
    int ok = nonnegative(n, len, "row length") == 0 && nonnegative(rows, len, "row count") == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < len; i++) {
            intptr_t d = (intptr_t)dst[i], s = (intptr_t)src[i];
            for (int64_t r = 0; r < rows[i]; r++, d += dstep[i], s += sstep[i])
                copy_one((char *)d, (const char *)s, (size_t)n[i], stream_min);
        }
        fence();
        Py_END_ALLOW_THREADS
    }
    release_views(v, 6);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", (PyCFunction)(void (*)(void))copy_runs, METH_FASTCALL, copy_runs_doc},
    {"copy_groups", (PyCFunction)(void (*)(void))copy_groups, METH_FASTCALL, copy_groups_doc},
    {"copy_runs_guarded", (PyCFunction)(void (*)(void))copy_runs_guarded, METH_FASTCALL,
     copy_runs_guarded_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copyrun",
    "Copy runs of mapped memory, the GIL released, large runs streamed.", -1, methods,
};

PyMODINIT_FUNC PyInit__copyrun(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMS", KVO_STREAMS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
