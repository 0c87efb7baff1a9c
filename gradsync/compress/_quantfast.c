/* gradsync's compiled quantizer kernels: the per-block arithmetic of int8, int4 and bf16
 * (compress/quantized.py's module docstring has the schedule; this file does its three
 * element-wise parts, one pass each).
 *
 * Why. Written as torch operations, the quantizers' arithmetic is a chain of whole-tensor
 * passes (absolute value, maximum, division, rounding, clamping, conversion, packing, the
 * decode and product that give back what was sent, the difference that is the residual,
 * the zeroing of non-finite values, the float64 widening of the owner's sum), each reading
 * and writing the bucket through memory, each a fresh tensor: one rank's int4 reduction of
 * a 3 MB bucket took 11-20 ms of one core, 15-26 ns an element, longer than a 1 Gbit/s link
 * takes to carry its bytes. Here each part is one pass over the block in cache.
 *
 * The same bits. For finite inputs each function computes exactly what the torch path of
 * quantized.py computes, in the same float32 (or float64) operations and order:
 *   scale = max|x| / QMAX (float32), safe = scale > 0 ? scale : 1, y = x / safe,
 *   int8: code = clamp(round_half_even(y), -127, 127);
 *   int4: code = clamp(round_half_even(y), -7, 7) + 8, two to a byte, the high nibble first,
 *         an odd block's last byte padded with 8 (zero);
 *   bf16: code = y rounded to bfloat16 (nearest, ties to even), two bytes little-endian;
 *   sent = decode(code) * scale, residual = x - sent, non-finite residuals zero;
 *   the owner's sum: total += (double)(decode(code) * scale), in the order called;
 *   the result: decode(code) * scale.
 * tests/test_compress_kernels.py checks it against the torch path. For non-finite inputs
 * (an overflow GradScaler will skip) the codes of the affected block may differ from the
 * torch path's (the conversion of NaN to an integer is not defined there), but a block
 * with a NaN gets a NaN scale, so what it sends is NaN on both paths, and the residual is
 * finite on both.
 *
 * Calls take the tensors' addresses (data_ptr()) and element counts as integers: the Python
 * side (quantized.py) passes contiguous tensors of the sizes named, and the GIL is released
 * around each pass. Kinds: 0 int8, 1 int4, 2 bf16 (quantized.py's KIND).
 */

/* GCC vectorises at -O2 only the loops whose count it knows (its "very cheap" model); these
 * passes are what the file is for, so they get -O3's (clang vectorises them at -O2). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { INT8 = 0, INT4 = 1, BF16 = 2 };

static const float QMAX[] = {127.0f, 7.0f, 1.0f};

static Py_ssize_t row_bytes(int kind, Py_ssize_t block) {
    return kind == INT8 ? block : kind == INT4 ? (block + 1) / 2 : 2 * block;
}

/* Each pass below is a plain loop over a row (or a piece of one) with no call and no
 * branch the compiler cannot turn into a select, so that it vectorises (GCC: with the -O3
 * above; 18 loops, by -fopt-info-vec). */

#define PIECE 1024 /* elements of a row whose codes are held at once (even: int4's pairs) */
#define BIG 12582912.0f /* 1.5 * 2^23: y + BIG - BIG rounds y to nearest, ties to even */

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* max |x| of a row as torch's abs().amax() gives it: NaN where the row holds one. The
 * absolute values' bits order as the values do, and a NaN's lie above infinity's. */
static float max_abs(const float *row, Py_ssize_t block) {
    uint32_t m = 0;
    for (Py_ssize_t i = 0; i < block; i++) {
        uint32_t b = bits_of(row[i]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    return m > 0x7F800000u ? NAN : float_of(m);
}

/* The codes of y = x / safe, as floats (what decode gives back), for a piece of a row:
 * integers rounded to nearest, ties to even (exact for |y| < 2^22: every finite y here is at
 * most QMAX), clamped to +-q; a NaN's code 0 (its block's scale is NaN: what it sends is NaN
 * whatever the code); bf16: y rounded to bfloat16, nearest, ties to even (c10::BFloat16). */
static void codes_of(int kind, const float *x, Py_ssize_t count, float safe, float *c) {
    if (kind == BF16) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t u = bits_of(x[i] / safe);
            uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
            c[i] = float_of((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded);
        }
        return;
    }
    float q = QMAX[kind];
    for (Py_ssize_t i = 0; i < count; i++) {
        float r = (x[i] / safe + BIG) - BIG;
        r = r > q ? q : r;
        r = r < -q ? -q : r;
        c[i] = r == r ? r : 0.0f;
    }
}

static void quantize_rows(int kind, const float *x, Py_ssize_t rows, Py_ssize_t block,
                          float *scales, uint8_t *codes, float *residual) {
    Py_ssize_t width = row_bytes(kind, block);
    float c[PIECE];
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = x + r * block;
        float scale = max_abs(row, block) / QMAX[kind];
        float safe = scale > 0.0f ? scale : 1.0f;
        scales[r] = scale;
        for (Py_ssize_t at = 0; at < block; at += PIECE) {
            Py_ssize_t count = block - at < PIECE ? block - at : PIECE;
            const float *xs = row + at;
            codes_of(kind, xs, count, safe, c);
            if (kind == INT8) {
                uint8_t *out = codes + r * width + at;
                for (Py_ssize_t i = 0; i < count; i++) out[i] = (uint8_t)(int8_t)(int32_t)c[i];
            } else if (kind == INT4) {
                uint8_t *out = codes + r * width + at / 2;
                for (Py_ssize_t j = 0; j < count / 2; j++) {
                    int32_t high = (int32_t)c[2 * j] + 8, low = (int32_t)c[2 * j + 1] + 8;
                    out[j] = (uint8_t)((high << 4) | low);
                }
                if (count % 2) out[count / 2] = (uint8_t)((((int32_t)c[count - 1] + 8) << 4) | 8);
            } else {
                uint16_t *out = (uint16_t *)(codes + r * width) + at;
                for (Py_ssize_t i = 0; i < count; i++) out[i] = (uint16_t)(bits_of(c[i]) >> 16);
            }
            if (residual != NULL) {
                float *left = residual + r * block + at;
                for (Py_ssize_t i = 0; i < count; i++) {
                    float v = xs[i] - c[i] * scale;
                    left[i] = v - v == 0.0f ? v : 0.0f; /* non-finite: zero */
                }
            }
        }
    }
}

static void decode_rows(int kind, const float *scales, const uint8_t *codes, Py_ssize_t rows,
                        Py_ssize_t block, float *out, double *total) {
    Py_ssize_t width = row_bytes(kind, block);
    float v[PIECE];
    for (Py_ssize_t r = 0; r < rows; r++) {
        float scale = scales[r];
        for (Py_ssize_t at = 0; at < block; at += PIECE) {
            Py_ssize_t count = block - at < PIECE ? block - at : PIECE;
            if (kind == INT8) {
                const int8_t *in = (const int8_t *)(codes + r * width + at);
                for (Py_ssize_t i = 0; i < count; i++) v[i] = (float)in[i] * scale;
            } else if (kind == INT4) {
                const uint8_t *in = codes + r * width + at / 2;
                for (Py_ssize_t j = 0; j < count / 2; j++) {
                    v[2 * j] = ((float)(in[j] >> 4) - 8.0f) * scale;
                    v[2 * j + 1] = ((float)(in[j] & 15) - 8.0f) * scale;
                }
                if (count % 2) v[count - 1] = ((float)(in[count / 2] >> 4) - 8.0f) * scale;
            } else {
                const uint16_t *in = (const uint16_t *)(codes + r * width) + at;
                for (Py_ssize_t i = 0; i < count; i++)
                    v[i] = float_of((uint32_t)in[i] << 16) * scale;
            }
            if (total != NULL) {
                double *t = total + r * block + at;
                for (Py_ssize_t i = 0; i < count; i++) t[i] += (double)v[i];
            } else {
                memcpy(out + r * block + at, v, (size_t)count * sizeof(float));
            }
        }
    }
}

/* A call's arguments: (kind, rows, block, then four addresses, each an int or None). */
typedef struct {
    int kind;
    Py_ssize_t rows, block;
    void *at[4];
} call_args;

static int parse(PyObject *const *args, Py_ssize_t nargs, const char *name, call_args *c) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "%s takes 7 arguments", name);
        return -1;
    }
    c->kind = (int)PyLong_AsLong(args[0]);
    c->rows = PyLong_AsSsize_t(args[1]);
    c->block = PyLong_AsSsize_t(args[2]);
    for (int i = 0; i < 4; i++)
        c->at[i] = args[3 + i] == Py_None ? NULL : PyLong_AsVoidPtr(args[3 + i]);
    if (PyErr_Occurred()) return -1;
    if (c->kind < INT8 || c->kind > BF16 || c->rows < 0 || c->block < 1) {
        PyErr_SetString(PyExc_ValueError, "_quantfast: bad kind, rows or block");
        return -1;
    }
    return 0;
}

/* quantize(kind, rows, block, x, scales, codes, residual or None) */
static PyObject *py_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    call_args c;
    if (parse(args, nargs, "quantize", &c) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    quantize_rows(c.kind, c.at[0], c.rows, c.block, c.at[1], c.at[2], c.at[3]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* dequantize(kind, rows, block, scales, codes, out float32 or None, total float64 or None):
 * out = decode * scale, or total += that, widened. */
static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    call_args c;
    if (parse(args, nargs, "dequantize", &c) < 0) return NULL;
    if ((c.at[2] == NULL) == (c.at[3] == NULL)) {
        PyErr_SetString(PyExc_ValueError, "dequantize: give exactly one of out and total");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_rows(c.kind, c.at[0], c.at[1], c.rows, c.block, c.at[2], c.at[3]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL,
     "Blocks -> scales, codes and (where given) the residual, in one pass."},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL,
     "Codes -> float32 values, or added to a float64 total."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quantfast", NULL, -1, methods};

/* The hash of this file that the build passed (setup.py, _native.py): gradsync loads a module
 * only when it matches the source beside it, so a stale build is never used. */
#ifndef GRADSYNC_SOURCE_HASH
#define GRADSYNC_SOURCE_HASH ""
#endif

PyMODINIT_FUNC PyInit__quantfast(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "source_hash", GRADSYNC_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
