/* The broker's fast path in C: the loop of Broker.process_batch (broker.py), for messages
 * that a node sends along a route it has used before.
 *
 * Why C: at 200-byte messages the Python loop's six pyzmq calls per message cap the broker at
 * ~0.45x of zmq.proxy, even with no checks at all (docs/PERFORMANCE.md). This loop makes the
 * same decisions with the same checks and leaves everything else to Python:
 *
 *   recv [rid, header, body]; the node of rid; its route cache (node.rcache) entry for the
 *   header's prefix (everything before its fixed 53-byte tail: kind, src, dst, run), whose
 *   target node has nothing held (target.pending empty); the tail's four keys in place and
 *   round >= -1; body <= max_frame; the sender's rate-limit credit (node.credit, a Credit:
 *   messages and bytes it may still send before Python refills it from its token buckets)
 *   has a message and a byte left  ->  send [target.rid, header, body], node.last_seen = now,
 *   credit.msgs -= 1, credit.nbytes -= header + body bytes.
 *
 * Any other message comes back to Python whole (a Held object per frame: the header's bytes,
 * the body as a zero-copy buffer that also answers frame.get("User-Id") and
 * frame.get(zmq.SRCFD)), exactly as Python's own recv would have handed it to dispatch().
 * Malformed framing (one frame, or more than two after the id) comes back as a reason.
 *
 * libzmq is not linked: the functions are the ones pyzmq loaded, their addresses handed over
 * by bind() (fedbus.broker.fastroute), so this module and pyzmq share one libzmq and one
 * socket. zmq_msg_t is libzmq's public 64-byte opaque message (zmq.h, stable since 4.0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    unsigned char _[64];
} __attribute__((aligned(sizeof(void *)))) zmq_msg_t;

#define ZMQ_SNDMORE 2
#define ZMQ_DONTWAIT 1
#define ZMQ_SRCFD 2

static struct {
    int (*msg_init)(zmq_msg_t *);
    int (*msg_recv)(zmq_msg_t *, void *, int);
    int (*msg_send)(zmq_msg_t *, void *, int);
    int (*msg_close)(zmq_msg_t *);
    int (*msg_move)(zmq_msg_t *, zmq_msg_t *);
    void *(*msg_data)(zmq_msg_t *);
    size_t (*msg_size)(const zmq_msg_t *);
    int (*msg_more)(const zmq_msg_t *);
    int (*msg_get)(const zmq_msg_t *, int);
    const char *(*msg_gets)(const zmq_msg_t *, const char *);
    int (*send)(void *, const void *, size_t, int);
    int (*zerrno)(void);
} Z;
static int bound = 0;

/* the header's tail (fedbus.broker.wire._TAIL, ">7sq5sQ5sQ4sd"): keys at fixed offsets */
#define TAIL_LEN 53
static const unsigned char K_ROUND[7] = {0xa5, 'r', 'o', 'u', 'n', 'd', 0xd3};
static const unsigned char K_SEQ[5] = {0xa3, 's', 'e', 'q', 0xcf};
static const unsigned char K_INC[5] = {0xa3, 'i', 'n', 'c', 0xcf};
static const unsigned char K_TS[4] = {0xa2, 't', 's', 0xcb};
#define MAX_HEADER_BYTES 2048

static PyObject *s_rcache, *s_pending, *s_rid, *s_last_seen, *s_credit;

/* ------------------------------------------------------------------ Credit: a node's budget */
typedef struct {
    PyObject_HEAD
    long long msgs;   /* messages it may still send without asking Python */
    long long nbytes; /* bytes likewise (may go below 0: the last message overdrew it) */
} Credit;

static PyTypeObject CreditType;

static int credit_init(Credit *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"msgs", "nbytes", NULL};
    self->msgs = self->nbytes = 0;
    return PyArg_ParseTupleAndKeywords(args, kwds, "|LL", kw, &self->msgs, &self->nbytes) ? 0
                                                                                          : -1;
}

static PyMemberDef credit_members[] = {
    {"msgs", T_LONGLONG, offsetof(Credit, msgs), 0, "messages left"},
    {"nbytes", T_LONGLONG, offsetof(Credit, nbytes), 0, "bytes left (may be negative)"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject CreditType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fedbus.broker._fastroute.Credit",
    .tp_basicsize = sizeof(Credit),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Credit(msgs=0, nbytes=0): what a node may still send through the fast path "
              "before the broker's Python side refills it from the node's token buckets.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)credit_init,
    .tp_members = credit_members,
};

/* ------------------------------------------------------------------ Held: one received frame */
typedef struct {
    PyObject_HEAD
    zmq_msg_t msg;
} Held;

static PyTypeObject HeldType;

static void held_dealloc(Held *self) {
    Z.msg_close(&self->msg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int held_getbuffer(Held *self, Py_buffer *view, int flags) {
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "a received frame is read-only");
        return -1;
    }
    /* the view holds a reference to self: the message outlives every view of it */
    return PyBuffer_FillInfo(view, (PyObject *)self, Z.msg_data(&self->msg),
                             (Py_ssize_t)Z.msg_size(&self->msg), 1, flags);
}

static Py_ssize_t held_len(Held *self) { return (Py_ssize_t)Z.msg_size(&self->msg); }

/* frame.get("User-Id") / frame.get(zmq.SRCFD), as zmq.Frame.get answers them */
static PyObject *held_get(Held *self, PyObject *key) {
    if (PyUnicode_Check(key)) {
        const char *name = PyUnicode_AsUTF8(key);
        if (name == NULL)
            return NULL;
        const char *v = Z.msg_gets(&self->msg, name);
        if (v == NULL) {
            PyErr_Format(PyExc_KeyError, "no %s property on this frame", name);
            return NULL;
        }
        return PyUnicode_FromString(v);
    }
    long option = PyLong_AsLong(key);
    if (option == -1 && PyErr_Occurred())
        return NULL;
    int v = Z.msg_get(&self->msg, (int)option);
    if (v == -1) {
        errno = Z.zerrno();
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    return PyLong_FromLong(v);
}

static PyObject *held_bytes(Held *self, void *closure) {
    return PyBytes_FromStringAndSize(Z.msg_data(&self->msg), (Py_ssize_t)Z.msg_size(&self->msg));
}

static PyObject *held_buffer(Held *self, void *closure) {
    return PyMemoryView_FromObject((PyObject *)self);
}

static PyMethodDef held_methods[] = {
    {"get", (PyCFunction)held_get, METH_O,
     "get(name or option): a message property, as zmq.Frame.get ('User-Id', zmq.SRCFD)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef held_getset[] = {
    {"bytes", (getter)held_bytes, NULL, "the frame's bytes (a copy)", NULL},
    {"buffer", (getter)held_buffer, NULL, "the frame as a memoryview (no copy)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyBufferProcs held_as_buffer = {(getbufferproc)held_getbuffer, NULL};
static PySequenceMethods held_as_sequence = {(lenfunc)held_len};

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fedbus.broker._fastroute.Held",
    .tp_basicsize = sizeof(Held),
    .tp_dealloc = (destructor)held_dealloc,
    .tp_as_sequence = &held_as_sequence,
    .tp_as_buffer = &held_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A frame received by the broker's fast path and handed to Python: a read-only "
              "buffer (no copy) with zmq.Frame's get('User-Id') / get(zmq.SRCFD).",
    .tp_methods = held_methods,
    .tp_getset = held_getset,
};

static PyObject *held_from(zmq_msg_t *msg) {
    Held *h = PyObject_New(Held, &HeldType);
    if (h == NULL) {
        Z.msg_close(msg);
        return NULL;
    }
    Z.msg_init(&h->msg);
    Z.msg_move(&h->msg, msg); /* no copy of the data; msg is left empty */
    Z.msg_close(msg);
    return (PyObject *)h;
}

/* ------------------------------------------------------------------ bind */
static PyObject *fr_bind(PyObject *mod, PyObject *args) {
    unsigned long long a[12];
    if (!PyArg_ParseTuple(args, "KKKKKKKKKKKK", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6],
                          &a[7], &a[8], &a[9], &a[10], &a[11]))
        return NULL;
    for (int i = 0; i < 12; i++)
        if (a[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "a libzmq function address is 0");
            return NULL;
        }
    Z.msg_init = (void *)(uintptr_t)a[0];
    Z.msg_recv = (void *)(uintptr_t)a[1];
    Z.msg_send = (void *)(uintptr_t)a[2];
    Z.msg_close = (void *)(uintptr_t)a[3];
    Z.msg_data = (void *)(uintptr_t)a[4];
    Z.msg_size = (void *)(uintptr_t)a[5];
    Z.msg_more = (void *)(uintptr_t)a[6];
    Z.msg_get = (void *)(uintptr_t)a[7];
    Z.msg_gets = (void *)(uintptr_t)a[8];
    Z.send = (void *)(uintptr_t)a[9];
    Z.zerrno = (void *)(uintptr_t)a[10];
    Z.msg_move = (void *)(uintptr_t)a[11];
    bound = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ route */
static int64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return (int64_t)v;
}

/* The cached target for this message (rcache: its sender's node.rcache), or NULL (with no
 * error set) to hand it to Python. */
static PyObject *fast_target(PyObject *rcache, const unsigned char *hdr, size_t n, size_t blen,
                             size_t max_frame) {
    if (n <= TAIL_LEN || n > MAX_HEADER_BYTES || blen > max_frame)
        return NULL;
    const unsigned char *t = hdr + n - TAIL_LEN;
    if (memcmp(t, K_ROUND, 7) || memcmp(t + 15, K_SEQ, 5) || memcmp(t + 28, K_INC, 5) ||
        memcmp(t + 41, K_TS, 4) || be64(t + 7) < -1)
        return NULL;
    PyObject *target = NULL;
    if (PyDict_CheckExact(rcache) && PyDict_GET_SIZE(rcache) > 0) {
        PyObject *prefix = PyBytes_FromStringAndSize((const char *)hdr, n - TAIL_LEN);
        if (prefix == NULL) {
            Py_DECREF(rcache);
            return NULL;
        }
        target = PyDict_GetItemWithError(rcache, prefix); /* borrowed */
        Py_DECREF(prefix);
        Py_XINCREF(target);
    }
    if (target == NULL)
        return NULL;
    PyObject *pending = PyObject_GetAttr(target, s_pending);
    if (pending == NULL) {
        Py_DECREF(target);
        return NULL;
    }
    int held = PyObject_IsTrue(pending);
    Py_DECREF(pending);
    if (held != 0) { /* something held for it: Python keeps the order */
        Py_DECREF(target);
        return NULL;
    }
    return target;
}

/* route(sock, nodes, max_msgs, max_frame, now) -> (more, routed, nbytes, used, held)
 *
 * more: False when the socket had nothing more (EAGAIN), True when max_msgs were taken or a
 * message comes back in held. held: None, (rid, reason) for malformed framing, or
 * (rid, header bytes, body Held) for Python's dispatch(). used: messages taken. */
static PyObject *fr_route(PyObject *mod, PyObject *args) {
    unsigned long long sockaddr;
    PyObject *nodes;
    Py_ssize_t max_msgs;
    unsigned long long max_frame;
    double now;
    if (!PyArg_ParseTuple(args, "KO!nKd", &sockaddr, &PyDict_Type, &nodes, &max_msgs, &max_frame,
                          &now))
        return NULL;
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq is not bound (call bind first)");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)sockaddr;
    PyObject *now_obj = PyFloat_FromDouble(now);
    if (now_obj == NULL)
        return NULL;
    long long routed = 0, nbytes = 0;
    Py_ssize_t used = 0;
    PyObject *held = NULL, *more = Py_True;
    zmq_msg_t rid, hdr, body;
    /* the sender of the last messages (a run of messages from one node is the usual case):
     * its rcache and credit, and whether its last_seen was set in this call. No Python code
     * runs inside this call, so they stay its own; `now` is one value for the whole call, so
     * setting last_seen once per run is the same as once per message. */
    PyObject *run_node = NULL, *run_rcache = NULL;
    Credit *run_credit = NULL;
    int run_seen = 0;

    while (used < max_msgs) {
        Z.msg_init(&rid);
        if (Z.msg_recv(&rid, sock, ZMQ_DONTWAIT) < 0) {
            int e = Z.zerrno();
            Z.msg_close(&rid);
            if (e == EAGAIN) {
                more = Py_False;
                break;
            }
            if (e == EINTR)
                continue;
            errno = e;
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        used++;
        PyObject *rid_b = PyBytes_FromStringAndSize(Z.msg_data(&rid), Z.msg_size(&rid));
        Z.msg_close(&rid);
        if (rid_b == NULL)
            goto fail;
        /* a ROUTER message always has a part after the id */
        Z.msg_init(&hdr);
        Z.msg_recv(&hdr, sock, ZMQ_DONTWAIT);
        if (!Z.msg_more(&hdr)) {
            Z.msg_close(&hdr);
            held = Py_BuildValue("(Ns)", rid_b, "message has 1 frame, expected 2 (header, body)");
            break;
        }
        Z.msg_init(&body);
        Z.msg_recv(&body, sock, ZMQ_DONTWAIT);
        if (Z.msg_more(&body)) {
            int extra = 0, more_parts = 1;
            zmq_msg_t rest;
            while (more_parts) {
                Z.msg_init(&rest);
                Z.msg_recv(&rest, sock, ZMQ_DONTWAIT);
                more_parts = Z.msg_more(&rest);
                Z.msg_close(&rest);
                extra++;
            }
            Z.msg_close(&hdr);
            Z.msg_close(&body);
            held = Py_BuildValue("(NN)", rid_b,
                                 PyUnicode_FromFormat("message has %d frames, expected 2",
                                                      2 + extra));
            break;
        }
        const unsigned char *h = Z.msg_data(&hdr);
        size_t n = Z.msg_size(&hdr), blen = Z.msg_size(&body);
        PyObject *node = PyDict_GetItemWithError(nodes, rid_b); /* borrowed */
        if (node != NULL && node != run_node) {
            Py_CLEAR(run_rcache);
            Py_CLEAR(run_credit);
            run_node = node;
            run_seen = 0;
            PyObject *cr = PyObject_GetAttr(node, s_credit);
            if (cr != NULL && Py_TYPE(cr) == &CreditType)
                run_credit = (Credit *)cr;
            else {
                Py_XDECREF(cr);
                PyErr_Clear(); /* no credit: every message of it goes to Python */
            }
            run_rcache = PyObject_GetAttr(node, s_rcache);
            if (run_rcache == NULL)
                run_node = NULL;
        }
        PyObject *target =
            node && run_rcache ? fast_target(run_rcache, h, n, blen, (size_t)max_frame) : NULL;
        if (PyErr_Occurred()) {
            Py_XDECREF(target);
            Py_DECREF(rid_b);
            Z.msg_close(&hdr);
            Z.msg_close(&body);
            goto fail;
        }
        /* out of credit: Python refills it from the node's buckets, or refuses the message as
         * rate_limited */
        if (target != NULL &&
            (run_credit == NULL || run_credit->msgs <= 0 || run_credit->nbytes <= 0))
            Py_CLEAR(target);
        if (target != NULL) {
            PyObject *trid = PyObject_GetAttr(target, s_rid);
            Py_DECREF(target);
            if (trid == NULL || !PyBytes_Check(trid)) {
                Py_XDECREF(trid);
                PyErr_Clear();
            } else if (Z.send(sock, PyBytes_AS_STRING(trid), PyBytes_GET_SIZE(trid),
                              ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0) {
                /* once the id is taken, a ROUTER takes the message's other parts */
                Py_DECREF(trid);
                Z.msg_send(&hdr, sock, ZMQ_SNDMORE | ZMQ_DONTWAIT);
                Z.msg_send(&body, sock, ZMQ_DONTWAIT);
                Z.msg_close(&hdr);
                Z.msg_close(&body);
                run_credit->msgs -= 1;
                run_credit->nbytes -= (long long)(n + blen);
                if (!run_seen) {
                    if (PyObject_SetAttr(node, s_last_seen, now_obj) < 0) {
                        Py_DECREF(rid_b);
                        goto fail;
                    }
                    run_seen = 1;
                }
                Py_DECREF(rid_b);
                routed++;
                nbytes += (long long)(n + blen);
                continue;
            } else {
                /* full or gone: Python's dispatch() holds it and says why */
                Py_DECREF(trid);
            }
        }
        PyObject *hdr_b = PyBytes_FromStringAndSize((const char *)h, n);
        Z.msg_close(&hdr);
        PyObject *body_o = held_from(&body);
        if (hdr_b == NULL || body_o == NULL) {
            Py_XDECREF(hdr_b);
            Py_XDECREF(body_o);
            Py_DECREF(rid_b);
            goto fail;
        }
        held = Py_BuildValue("(NNN)", rid_b, hdr_b, body_o);
        break;
    }
    Py_DECREF(now_obj);
    Py_XDECREF(run_rcache);
    Py_XDECREF(run_credit);
    if (held == NULL) {
        if (PyErr_Occurred())
            return NULL;
        held = Py_None;
        Py_INCREF(held);
    }
    return Py_BuildValue("(OLLnN)", more, routed, nbytes, used, held);
fail:
    Py_DECREF(now_obj);
    Py_XDECREF(run_rcache);
    Py_XDECREF(run_credit);
    return NULL;
}

static PyMethodDef fr_methods[] = {
    {"bind", fr_bind, METH_VARARGS,
     "bind(msg_init, msg_recv, msg_send, msg_close, msg_data, msg_size, msg_more, msg_get, "
     "msg_gets, send, errno, msg_move): the addresses of pyzmq's libzmq functions"},
    {"route", fr_route, METH_VARARGS,
     "route(socket address, nodes, max_msgs, max_frame, now) -> "
     "(more, routed, nbytes, used, held)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef fr_module = {PyModuleDef_HEAD_INIT, "_fastroute",
                                       "The broker's fast path in C (see _fastroute.c).", -1,
                                       fr_methods};

PyMODINIT_FUNC PyInit__fastroute(void) {
    if (PyType_Ready(&HeldType) < 0 || PyType_Ready(&CreditType) < 0)
        return NULL;
    s_rcache = PyUnicode_InternFromString("rcache");
    s_pending = PyUnicode_InternFromString("pending");
    s_rid = PyUnicode_InternFromString("rid");
    s_last_seen = PyUnicode_InternFromString("last_seen");
    s_credit = PyUnicode_InternFromString("credit");
    PyObject *m = PyModule_Create(&fr_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HeldType);
    if (PyModule_AddObject(m, "Held", (PyObject *)&HeldType) < 0) {
        Py_DECREF(&HeldType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CreditType);
    if (PyModule_AddObject(m, "Credit", (PyObject *)&CreditType) < 0) {
        Py_DECREF(&CreditType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
