/* The host update's chains (host_update.py) in one C call each: every op of a chain over a block
   of BLOCK elements, then the next block, so a block's operands stay in L1 and memory streams in
   while the ops compute. The numpy path makes one call, and one pass over L2, per op and 64K
   block; this loop is what a fused optimizer kernel does, for whatever chain the apply graph
   holds. Each op is one IEEE float32 operation (no contraction into FMA, no fast-math), so the
   result equals numpy's and ONNX Runtime's bit for bit.

   run(ops, operands, kinds, size):
     ops       bytes, int32 rows (opcode, out, a, b): slots, b = -1 for a unary op
     operands  tuple, one per slot: a float32 C-contiguous buffer, or None for a scratch slot
     kinds     bytes, int32 per slot: 0 array of `size` elements, 1 scalar, 2 scratch
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 1024 /* floats: AdamW's five operands in 20 of L1's 32 KB (512: 4.9 ms, 2048: 5.4) */

enum { OP_COPY, OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_SQRT, OP_NEG, OP_ABS, OP_RECIPROCAL };
enum { KIND_ARRAY, KIND_SCALAR, KIND_SCRATCH };

typedef struct {
    int32_t op, out, a, b;
} Op;

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch((address), 1, 3) /* for writing, into L1 */
#else
#define PREFETCH(address) ((void)(address))
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default"))) /* AVX2 where the CPU has it */
#else
#define CLONES
#endif

/* Elementwise over one block; in-place ops alias an output with an input at the same index only,
   which vectorizes safely (ivdep: no runtime overlap checks, which would refuse exact aliasing). */
#define EACH _Pragma("GCC ivdep") for (Py_ssize_t i = 0; i < n; i++)

#define BINARY(EXPR)                                  \
    if (kinds[op.a] == KIND_SCALAR) {                 \
        const float a = x[0];                         \
        EACH {                                        \
            const float b = y[i];                     \
            o[i] = EXPR;                              \
        }                                             \
    } else if (kinds[op.b] == KIND_SCALAR) {          \
        const float b = y[0];                         \
        EACH {                                        \
            const float a = x[i];                     \
            o[i] = EXPR;                              \
        }                                             \
    } else {                                          \
        EACH {                                        \
            const float a = x[i], b = y[i];           \
            o[i] = EXPR;                              \
        }                                             \
    }                                                 \
    break;

#define UNARY(EXPR)                                   \
    if (kinds[op.a] == KIND_SCALAR) {                 \
        const float a = x[0];                         \
        EACH o[i] = EXPR;                             \
    } else {                                          \
        EACH {                                        \
            const float a = x[i];                     \
            o[i] = EXPR;                              \
        }                                             \
    }                                                 \
    break;

static float *at(float *base, int32_t kind, Py_ssize_t start) {
    return kind == KIND_ARRAY ? base + start : base;
}

CLONES static void run_blocks(const Op *ops, Py_ssize_t count, float **base, const int32_t *kinds,
                              Py_ssize_t slots, Py_ssize_t size) {
    for (Py_ssize_t start = 0; start < size; start += BLOCK) {
        const Py_ssize_t n = size - start < BLOCK ? size - start : BLOCK;
        /* Ask for every array's lines of the block at once: their misses overlap, where the ops
           would wait for them one array after the other (the MLP's AdamW 4.7 vs 5.5 ms; asking
           for a later block instead, into L1 or L2, was slower). */
        for (Py_ssize_t s = 0; s < slots; s++)
            if (kinds[s] == KIND_ARRAY)
                for (Py_ssize_t i = 0; i < n; i += 16)
                    PREFETCH(base[s] + start + i);
        for (Py_ssize_t k = 0; k < count; k++) {
            const Op op = ops[k];
            float *o = at(base[op.out], kinds[op.out], start);
            const float *x = at(base[op.a], kinds[op.a], start);
            const float *y = op.b < 0 ? x : at(base[op.b], kinds[op.b], start);
            switch (op.op) {
            case OP_ADD: BINARY(a + b)
            case OP_SUB: BINARY(a - b)
            case OP_MUL: BINARY(a * b)
            case OP_DIV: BINARY(a / b)
            case OP_COPY: UNARY(a)
            case OP_SQRT: UNARY(sqrtf(a))
            case OP_NEG: UNARY(-a)
            case OP_ABS: UNARY(fabsf(a))
            case OP_RECIPROCAL: UNARY(1.0f / a)
            default: break;
            }
        }
    }
}

static int valid(const Op *ops, Py_ssize_t count, const int32_t *kinds, Py_ssize_t slots) {
    for (Py_ssize_t s = 0; s < slots; s++)
        if (kinds[s] < KIND_ARRAY || kinds[s] > KIND_SCRATCH)
            return 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        const Op op = ops[k];
        if (op.op < OP_COPY || op.op > OP_RECIPROCAL || op.out < 0 || op.out >= slots || op.a < 0 ||
            op.a >= slots || op.b < -1 || op.b >= slots || kinds[op.out] == KIND_SCALAR)
            return 0;
        if (op.op >= OP_ADD && op.op <= OP_DIV && op.b < 0)
            return 0;
    }
    return 1;
}

static PyObject *run(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer ops, kinds_buffer;
    PyObject *operands;
    Py_ssize_t size, held = 0;
    if (!PyArg_ParseTuple(args, "y*O!y*n", &ops, &PyTuple_Type, &operands, &kinds_buffer, &size))
        return NULL;
    const int32_t *kinds = (const int32_t *)kinds_buffer.buf;
    const Op *program = (const Op *)ops.buf;
    const Py_ssize_t count = ops.len / (Py_ssize_t)sizeof(Op), slots = PyTuple_GET_SIZE(operands);
    const char *problem = NULL;
    Py_buffer *views = PyMem_Calloc(slots + 1, sizeof(Py_buffer));
    float **base = PyMem_Calloc(slots + 1, sizeof(float *)), *scratch = NULL;
    if (!views || !base)
        problem = "no memory for the operands";
    else if (kinds_buffer.len != slots * (Py_ssize_t)sizeof(int32_t) || size < 0 ||
             ops.len % (Py_ssize_t)sizeof(Op) || !valid(program, count, kinds, slots))
        problem = "a malformed chain";
    Py_ssize_t scratch_count = 0;
    for (Py_ssize_t s = 0; !problem && s < slots; s++)
        scratch_count += kinds[s] == KIND_SCRATCH;
    if (!problem && scratch_count && !(scratch = PyMem_Malloc(sizeof(float) * BLOCK * scratch_count)))
        problem = "no memory for scratch";
    for (Py_ssize_t s = 0, next = 0; !problem && s < slots; s++) {
        if (kinds[s] == KIND_SCRATCH) {
            base[s] = scratch + BLOCK * next++;
            continue;
        }
        int written = 0;
        for (Py_ssize_t k = 0; k < count; k++)
            written |= program[k].out == s;
        PyObject *item = PyTuple_GET_ITEM(operands, s);
        const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (written ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(item, &views[held], flags) < 0) {
            PyErr_Clear();
            problem = "an operand is not a contiguous buffer (writable where written)";
            break;
        }
        Py_buffer *view = &views[held++];
        const Py_ssize_t needed = kinds[s] == KIND_ARRAY ? size : 1;
        if (view->itemsize != 4 || !view->format || view->format[0] != 'f' || view->format[1] ||
            view->len / 4 < needed)
            problem = "an operand is not float32 of the chain's size";
        base[s] = (float *)view->buf;
    }
    if (!problem) {
        Py_BEGIN_ALLOW_THREADS run_blocks(program, count, base, kinds, slots, size);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(base);
    PyMem_Free(scratch);
    PyBuffer_Release(&ops);
    PyBuffer_Release(&kinds_buffer);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "Run a chain of float32 elementwise ops block by block, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
