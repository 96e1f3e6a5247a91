// Padding-free MoE dispatch/combine kernels for MindSpore `ops.Custom(func_type="aot")` on CPU.
//
// Build: g++ -O2 -shared -fPIC [-fopenmp] moe_dispatch.cc -o moe_dispatch.so
// (ms_efficient.moe.kernels does this on first use). No dependencies beyond libstdc++.
//
// Every entry point has the aot signature
//   extern "C" int Fn(int nparam, void **params, int *ndims, int64_t **shapes,
//                     const char **dtypes, void *stream, void *extra)
// with params = inputs then outputs. It returns 0 on success, else (MindSpore then raises with
// the number) 1 wrong parameter count, 2 bad dtype, 3 bad shape, 4 index out of [-1, rows).
// Names: T tokens, N permuted rows, H hidden.
// Float tensors of one call share one dtype, float32 or float16 (fp16 accumulates in fp32);
// index tensors are int32, where -1 means "no row" and anything else outside [0, rows) is an
// error.
//
//   MoePermute(x [T,H], idx [N]) -> y [N,H]                 y[i] = x[idx[i]]          (0 if -1)
//   MoePermuteWeighted(x [T,H], idx [N], w [N]) -> y [N,H]  y[i] = w[i] * x[idx[i]]   (0 if -1)
//   MoeUnpermuteCombine(y [N,H], tok [N], w [N], like [T,...]) -> out [T,H]
//                                      out[t] = sum_{r: tok[r]==t} w[r] * y[r]
//   MoeUnpermuteSum(y [N,H], tok [N], like [T,...]) -> out [T,H]    same with w = 1
//   MoeGatherDot(a [T,H], idx [N], b [N,H]) -> d [N]        d[i] = <a[idx[i]], b[i]>  (0 if -1)
//
// `like` only supplies T (its first dimension): MindSpore infers output shapes from input
// shapes, never from data. The combine is deterministic: rows are grouped per destination
// token in a CSR built serially from `tok`, and each token sums its rows in increasing r, so
// the result does not depend on the thread count (no atomics).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum Status { kOk = 0, kBadArity = 1, kBadDtype = 2, kBadShape = 3, kBadIndex = 4 };

// Work (rows * H elements) below which a kernel stays on one thread: forking costs ~µs.
constexpr int64_t kParallelMinWork = 1 << 15;

enum class FloatType { kF32, kF16, kOther };

FloatType float_type(const char *dtype) {
  if (std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0) {
    return FloatType::kF32;
  }
  if (std::strcmp(dtype, "float16") == 0) return FloatType::kF16;
  return FloatType::kOther;
}

bool is_int32(const char *dtype) {
  return std::strcmp(dtype, "int32") == 0 || std::strcmp(dtype, "int") == 0;
}

// Checks that idx[0..n) lies in [-1, rows); the loop is cheap next to the row copies.
bool indices_ok(const int32_t *idx, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < -1 || idx[i] >= rows) return false;
  }
  return true;
}

// y[i] = (w ? w[i] : 1) * x[idx[i]]; zero row for idx[i] == -1.
template <typename F>
void permute(const F *x, const int32_t *idx, const F *w, F *y, int64_t n, int64_t h) {
#pragma omp parallel for schedule(static) if (n * h >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    F *dst = y + i * h;
    const int32_t src = idx[i];
    if (src < 0) {
      std::memset(dst, 0, sizeof(F) * h);
    } else if (w == nullptr) {
      std::memcpy(dst, x + static_cast<int64_t>(src) * h, sizeof(F) * h);
    } else {
      const F *row = x + static_cast<int64_t>(src) * h;
      const float wi = static_cast<float>(w[i]);
      for (int64_t j = 0; j < h; ++j) dst[j] = static_cast<F>(wi * static_cast<float>(row[j]));
    }
  }
}

// out[t] = sum over rows r with tok[r] == t, in increasing r, of (w ? w[r] : 1) * y[r].
template <typename F>
void unpermute(const F *y, const int32_t *tok, const F *w, F *out, int64_t n, int64_t t,
               int64_t h) {
  // Step 1: CSR of rows per destination token (counting sort, stable in r).
  std::vector<int64_t> start(t + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    if (tok[r] >= 0) ++start[tok[r] + 1];
  }
  for (int64_t i = 0; i < t; ++i) start[i + 1] += start[i];
  std::vector<int64_t> rows(start[t]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < n; ++r) {
    if (tok[r] >= 0) rows[fill[tok[r]]++] = r;
  }
  // Step 2: every token sums its own rows; threads never share an output row.
#pragma omp parallel if (n * h >= kParallelMinWork)
  {
    std::vector<float> acc(h);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = start[i]; p < start[i + 1]; ++p) {
        const int64_t r = rows[p];
        const F *src = y + r * h;
        const float wr = w == nullptr ? 1.0f : static_cast<float>(w[r]);
        for (int64_t j = 0; j < h; ++j) acc[j] += wr * static_cast<float>(src[j]);
      }
      F *dst = out + i * h;
      for (int64_t j = 0; j < h; ++j) dst[j] = static_cast<F>(acc[j]);
    }
  }
}

// d[i] = <a[idx[i]], b[i]>; 0 for idx[i] == -1.
template <typename F>
void gather_dot(const F *a, const int32_t *idx, const F *b, F *d, int64_t n, int64_t h) {
#pragma omp parallel for schedule(static) if (n * h >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.0f;
    if (idx[i] >= 0) {
      const F *ar = a + static_cast<int64_t>(idx[i]) * h;
      const F *br = b + i * h;
      for (int64_t j = 0; j < h; ++j) s += static_cast<float>(ar[j]) * static_cast<float>(br[j]);
    }
    d[i] = static_cast<F>(s);
  }
}

// Argument checks over the aot arrays: params[i] is a 2-D matrix / a 1-D int32 index of length
// n / a 1-D weight of length n, with float dtype ft where it is float.
struct Check {
  int *ndims;
  int64_t **shapes;
  const char **dtypes;

  bool matrix(int i, FloatType ft) const { return ndims[i] == 2 && float_type(dtypes[i]) == ft; }
  bool index(int i, int64_t n) const {
    return ndims[i] == 1 && shapes[i][0] == n && is_int32(dtypes[i]);
  }
  bool weight(int i, int64_t n, FloatType ft) const {
    return ndims[i] == 1 && shapes[i][0] == n && float_type(dtypes[i]) == ft;
  }
};

// Runs BODY with F = the C++ type of float dtype `ft`, then returns kOk (kBadDtype if none).
#define MOE_DISPATCH_FLOAT(ft, BODY)     \
  switch (ft) {                          \
    case FloatType::kF32: {              \
      using F = float;                   \
      BODY;                              \
      return kOk;                        \
    }                                    \
    case FloatType::kF16: {              \
      using F = _Float16;                \
      BODY;                              \
      return kOk;                        \
    }                                    \
    default:                             \
      return kBadDtype;                  \
  }

int permute_entry(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                  bool weighted) {
  // params: x [T,H], idx [N], (w [N]), y [N,H]
  if (nparam != (weighted ? 4 : 3)) return kBadArity;
  const Check c{ndims, shapes, dtypes};
  const int out = nparam - 1;
  const FloatType ft = float_type(dtypes[0]);
  if (ft == FloatType::kOther) return kBadDtype;
  if (!c.matrix(0, ft) || ndims[1] != 1 || !c.matrix(out, ft)) return kBadShape;
  const int64_t t = shapes[0][0], h = shapes[0][1], n = shapes[1][0];
  if (!c.index(1, n)) return kBadDtype;
  if (weighted && !c.weight(2, n, ft)) return kBadShape;
  if (shapes[out][0] != n || shapes[out][1] != h) return kBadShape;
  const int32_t *idx = static_cast<const int32_t *>(params[1]);
  if (!indices_ok(idx, n, t)) return kBadIndex;
  MOE_DISPATCH_FLOAT(ft, permute<F>(static_cast<const F *>(params[0]), idx,
                                    weighted ? static_cast<const F *>(params[2]) : nullptr,
                                    static_cast<F *>(params[out]), n, h))
}

int unpermute_entry(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    bool weighted) {
  // params: y [N,H], tok [N], (w [N]), like [T,...], out [T,H]
  if (nparam != (weighted ? 5 : 4)) return kBadArity;
  const Check c{ndims, shapes, dtypes};
  const int like = nparam - 2, out = nparam - 1;
  const FloatType ft = float_type(dtypes[0]);
  if (ft == FloatType::kOther) return kBadDtype;
  if (!c.matrix(0, ft) || !c.matrix(out, ft) || ndims[like] < 1) return kBadShape;
  const int64_t n = shapes[0][0], h = shapes[0][1];
  if (!c.index(1, n)) return kBadShape;
  if (weighted && !c.weight(2, n, ft)) return kBadShape;
  const int64_t t = shapes[like][0];
  if (shapes[out][0] != t || shapes[out][1] != h) return kBadShape;
  const int32_t *tok = static_cast<const int32_t *>(params[1]);
  if (!indices_ok(tok, n, t)) return kBadIndex;
  MOE_DISPATCH_FLOAT(ft, unpermute<F>(static_cast<const F *>(params[0]), tok,
                                      weighted ? static_cast<const F *>(params[2]) : nullptr,
                                      static_cast<F *>(params[out]), n, t, h))
}

}  // namespace

extern "C" {

int MoePermute(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
               void *stream, void *extra) {
  return permute_entry(nparam, params, ndims, shapes, dtypes, /*weighted=*/false);
}

int MoePermuteWeighted(int nparam, void **params, int *ndims, int64_t **shapes,
                       const char **dtypes, void *stream, void *extra) {
  return permute_entry(nparam, params, ndims, shapes, dtypes, /*weighted=*/true);
}

int MoeUnpermuteCombine(int nparam, void **params, int *ndims, int64_t **shapes,
                        const char **dtypes, void *stream, void *extra) {
  return unpermute_entry(nparam, params, ndims, shapes, dtypes, /*weighted=*/true);
}

int MoeUnpermuteSum(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    void *stream, void *extra) {
  return unpermute_entry(nparam, params, ndims, shapes, dtypes, /*weighted=*/false);
}

int MoeGatherDot(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                 void *stream, void *extra) {
  // params: a [T,H], idx [N], b [N,H], d [N]
  if (nparam != 4) return kBadArity;
  const Check c{ndims, shapes, dtypes};
  const FloatType ft = float_type(dtypes[0]);
  if (ft == FloatType::kOther) return kBadDtype;
  if (!c.matrix(0, ft) || ndims[1] != 1 || !c.matrix(2, ft)) return kBadShape;
  const int64_t t = shapes[0][0], h = shapes[0][1], n = shapes[1][0];
  if (!c.index(1, n) || !c.weight(3, n, ft)) return kBadShape;
  if (shapes[2][0] != n || shapes[2][1] != h) return kBadShape;
  const int32_t *idx = static_cast<const int32_t *>(params[1]);
  if (!indices_ok(idx, n, t)) return kBadIndex;
  MOE_DISPATCH_FLOAT(ft, gather_dot<F>(static_cast<const F *>(params[0]), idx,
                                       static_cast<const F *>(params[2]),
                                       static_cast<F *>(params[3]), n, h))
}

}  // extern "C"
