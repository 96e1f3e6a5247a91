// Padding-free grouped matmul for MindSpore `ops.Custom(func_type="aot")` on CPU: each expert's
// weights multiply only its own rows, and the group sizes are data (an int32 tensor), so the
// shapes stay static while the split changes every step.
//
// Build (ms_efficient.moe.grouped_matmul does this on first use):
//   with BLAS:   g++ -O2 -shared -fPIC -fopenmp -DMOE_GMM_OPENBLAS -I<inc> grouped_matmul.cc
//                    -L<lib> -l<blas> -Wl,-rpath,<lib> -o grouped_matmul.so
//                where <inc>, <lib>, <blas> come from the pip package scipy-openblas32
//                (its symbols carry a `scipy_` prefix: scipy_cblas_sgemm);
//   without:     the same minus the BLAS flags: a cache-tiled C++ loop (OpenMP over rows).
//
// Entry points have the aot signature (params = inputs then outputs; 0 = success), with the
// error codes of moe_dispatch.cc: 1 wrong parameter count, 2 bad dtype, 3 bad shape, 4 group
// sizes out of range (a negative size, or sizes summing to more than N rows).
// Names: N rows, H input width, F output width, E groups (experts). Group e owns rows
// off_e .. off_e + size_e of every [N, .] tensor, off = exclusive cumsum of `sizes`; rows at or
// past sum(sizes) belong to no group (a buffer's unused tail).
//
//   MoeGroupedMatmul(x [N,H], w [E,H,F], sizes [E]) -> y [N,F]
//       y[rows e] = x[rows e] @ w[e]; tail rows of y are 0
//   MoeGroupedMatmulTransW(dy [N,F], w [E,H,F], sizes [E]) -> dx [N,H]
//       dx[rows e] = dy[rows e] @ w[e]^T; tail rows 0 (the backward of y wrt x)
//   MoeGroupedMatmulWeightGrad(x [N,H], dy [N,F], sizes [E]) -> dw [E,H,F]
//       dw[e] = x[rows e]^T @ dy[rows e]; 0 for an empty group (the backward of y wrt w)
//
// Float tensors of one call share one dtype: float32, or float16 (converted to float32 scratch,
// computed in float32, rounded once). `sizes` is int32.
// Plain C helpers for ctypes: MoeGroupedMatmulSetThreads(n) / MoeGroupedMatmulGetThreads() set
// and read the thread count (OpenMP threads over single-threaded sgemm tasks with BLAS, over
// row blocks in the fallback build); MoeGroupedMatmulBackend()
// returns "openblas" or "loop".
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef MOE_GMM_OPENBLAS
#include <cblas.h>
#endif

namespace {

enum Status { kOk = 0, kBadArity = 1, kBadDtype = 2, kBadShape = 3, kBadSizes = 4 };

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

#ifndef MOE_GMM_OPENBLAS
// Tile of the fallback: kRowBlock rows of C share every loaded row of B, and kColBlock columns
// keep those C rows (4 x 256 floats = 4 KiB) in L1 while B's rows stream through. The micro
// kernel below is written for kRowBlock = 4.
constexpr int64_t kRowBlock = 4;
constexpr int64_t kColBlock = 256;
// Work (m * n * k multiply-adds) below which the fallback stays on one thread.
constexpr int64_t kParallelMinWork = 1 << 18;
// Threads of the fallback (0 = OpenMP's default), set by MoeGroupedMatmulSetThreads: a global
// like OpenBLAS's own, because kernels run on MindSpore's threads, not the caller's.
std::atomic<int> g_threads{0};

int loop_threads() {
#ifdef _OPENMP
  const int t = g_threads.load();
  return t > 0 ? t : omp_get_max_threads();
#else
  return 1;
#endif
}

// C[m,n] = A[m,k] @ B[k,n], all row-major and contiguous. Every loaded row of B updates
// kRowBlock rows of C in one vectorised pass (4 multiply-adds per load of B).
void gemm_nn_loop(int64_t m, int64_t n, int64_t k, const float *__restrict a,
                  const float *__restrict b, float *__restrict c) {
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static) num_threads(loop_threads()) \
    if (m * n * k >= kParallelMinWork)
  for (int64_t ib = 0; ib < row_blocks; ++ib) {
    const int64_t i0 = ib * kRowBlock, rows = std::min(kRowBlock, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += kColBlock) {
      const int64_t cols = std::min(kColBlock, n - j0);
      float acc[kRowBlock][kColBlock] = {};
      // Rows past m (a partial last block) get weight 0 and are never stored.
      for (int64_t p = 0; p < k; ++p) {
        const float *__restrict brow = b + p * n + j0;
        float a_r[kRowBlock];
        for (int64_t r = 0; r < kRowBlock; ++r) a_r[r] = r < rows ? a[(i0 + r) * k + p] : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) {
          const float bj = brow[j];
          acc[0][j] += a_r[0] * bj;
          acc[1][j] += a_r[1] * bj;
          acc[2][j] += a_r[2] * bj;
          acc[3][j] += a_r[3] * bj;
        }
      }
      for (int64_t r = 0; r < rows; ++r) std::copy_n(acc[r], cols, c + (i0 + r) * n + j0);
    }
  }
}

// dst[cols, rows] = src[rows, cols]^T.
void transpose(const float *src, int64_t rows, int64_t cols, std::vector<float> *dst) {
  dst->resize(rows * cols);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) (*dst)[j * rows + i] = src[i * cols + j];
  }
}
#endif

#ifndef MOE_GMM_OPENBLAS
// C[m,n] = op(A) @ op(B) with op(A) [m,k], op(B) [k,n]; A is stored [m,k] (or [k,m] when
// trans_a), B [k,n] (or [n,k] when trans_b); row-major, contiguous; C is overwritten.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float *a,
           const float *b, float *c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill_n(c, m * n, 0.0f);
    return;
  }
  // A transpose costs one pass over a matrix the product reads k or m times.
  std::vector<float> at, bt;
  if (trans_a) transpose(a, k, m, &at);
  if (trans_b) transpose(b, n, k, &bt);
  gemm_nn_loop(m, n, k, trans_a ? at.data() : a, trans_b ? bt.data() : b, c);
}
#endif

// Which product of the contract an entry point computes.
enum class Product { kForward, kTransW, kWeightGrad };

// Checks the sizes (each >= 0, sum <= rows) and returns the exclusive cumsum [E+1].
bool group_offsets(const int32_t *sizes, int64_t e, int64_t rows, std::vector<int64_t> *off) {
  off->assign(e + 1, 0);
  for (int64_t g = 0; g < e; ++g) {
    if (sizes[g] < 0) return false;
    (*off)[g + 1] = (*off)[g] + sizes[g];
  }
  return (*off)[e] <= rows;
}

#ifdef MOE_GMM_OPENBLAS
// Threads over the products' tasks (0 = OpenMP's default), set by MoeGroupedMatmulSetThreads.
// OpenBLAS itself runs single-threaded inside each task: its own spinning threads fought
// MindSpore's pool on the 2-core build machine (5x slower), while independent tasks on
// OpenMP threads do not. A global, because kernels run on MindSpore's threads.
std::atomic<int> g_task_threads{1};
// Rows (forward, trans) or columns (weight grad) of one task: small enough that 8 experts'
// groups split into a few tasks per thread, large enough that each sgemm stays efficient.
constexpr int64_t kTaskSpan = 256;
// Work (multiply-adds) below which one thread does everything.
constexpr int64_t kParallelMinWork = 1 << 20;

int task_threads() {
#ifdef _OPENMP
  const int t = g_task_threads.load();
  return t > 0 ? t : omp_get_max_threads();
#else
  return 1;
#endif
}

// C = op(A) @ op(B) with explicit leading dimensions (row-major).
void sgemm_ld(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float *a,
              int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
                    static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
                    static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0f, c,
                    static_cast<blasint>(ldc));
}
#endif

// The three products in float32 over contiguous buffers (see the header comment).
//   kForward:    a = x [N,H],  w [E,H,F]  -> out [N,F]
//   kTransW:     a = dy [N,F], w [E,H,F]  -> out [N,H]
//   kWeightGrad: a = x [N,H],  b = dy [N,F] -> out [E,H,F]
// With BLAS, every group is cut into tasks of kTaskSpan rows (forward, trans: the rows of a
// group are independent) or of kTaskSpan output columns (weight grad: dw[e][:, cols] needs
// only dy[:, cols]), run on task_threads() OpenMP threads, each a single-threaded sgemm that
// writes its own block of `out`: no two tasks write the same element, so the result does not
// depend on the thread count.
void grouped(Product product, const float *a, const float *b, float *out,
             const std::vector<int64_t> &off, int64_t n_rows, int64_t h, int64_t f) {
  const int64_t e = static_cast<int64_t>(off.size()) - 1;
#ifdef MOE_GMM_OPENBLAS
  struct Task { int64_t g, lo, hi; };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (product == Product::kWeightGrad) {
      if (m == 0) {
        std::fill_n(out + g * h * f, h * f, 0.0f);   // an empty group's gradient
        continue;
      }
      for (int64_t lo = 0; lo < f; lo += kTaskSpan) tasks.push_back({g, lo, std::min(f, lo + kTaskSpan)});
    } else {
      for (int64_t lo = 0; lo < m; lo += kTaskSpan) tasks.push_back({g, lo, std::min(m, lo + kTaskSpan)});
    }
  }
  const int64_t work = off[e] * h * f;
  const int64_t count = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(task_threads()) \
    if (count > 1 && work >= kParallelMinWork)
  for (int64_t i = 0; i < count; ++i) {
    const Task t = tasks[i];
    const int64_t r0 = off[t.g], m = off[t.g + 1] - off[t.g], span = t.hi - t.lo;
    const float *w = b + t.g * h * f;
    switch (product) {
      case Product::kForward:
        sgemm_ld(false, false, span, f, h, a + (r0 + t.lo) * h, h, w, f, out + (r0 + t.lo) * f, f);
        break;
      case Product::kTransW:
        sgemm_ld(false, true, span, h, f, a + (r0 + t.lo) * f, f, w, f, out + (r0 + t.lo) * h, h);
        break;
      case Product::kWeightGrad:
        sgemm_ld(true, false, h, span, m, a + r0 * h, h, b + r0 * f + t.lo, f,
                 out + t.g * h * f + t.lo, f);
        break;
    }
  }
#else
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r0 = off[g], m = off[g + 1] - off[g];
    switch (product) {
      case Product::kForward:
        sgemm(false, false, m, f, h, a + r0 * h, b + g * h * f, out + r0 * f);
        break;
      case Product::kTransW:
        sgemm(false, true, m, h, f, a + r0 * f, b + g * h * f, out + r0 * h);
        break;
      case Product::kWeightGrad:
        sgemm(true, false, h, f, m, a + r0 * h, b + r0 * f, out + g * h * f);
        break;
    }
  }
#endif
  if (product != Product::kWeightGrad) {
    const int64_t width = product == Product::kForward ? f : h;
    std::fill(out + off[e] * width, out + n_rows * width, 0.0f);
  }
}

std::vector<float> to_float(const _Float16 *src, int64_t count) {
  std::vector<float> dst(count);
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
  return dst;
}

int64_t numel(int nd, const int64_t *shape) {
  int64_t count = 1;
  for (int i = 0; i < nd; ++i) count *= shape[i];
  return count;
}

// params: a, b, sizes [E] int32, out. Shapes per product as in `grouped`.
int entry(Product product, int nparam, void **params, int *ndims, int64_t **shapes,
          const char **dtypes) {
  if (nparam != 4) return kBadArity;
  const FloatType ft = float_type(dtypes[0]);
  if (ft == FloatType::kOther || float_type(dtypes[1]) != ft || float_type(dtypes[3]) != ft) {
    return kBadDtype;
  }
  if (!is_int32(dtypes[2])) return kBadDtype;
  const bool b_is_weight = product != Product::kWeightGrad;
  if (ndims[0] != 2 || ndims[1] != (b_is_weight ? 3 : 2) || ndims[2] != 1) return kBadShape;
  const int64_t n_rows = shapes[0][0], e = shapes[2][0];
  int64_t h, f;
  if (b_is_weight) {
    // w [E,H,F]; a is x [N,H] (forward) or dy [N,F] (trans)
    h = shapes[1][1];
    f = shapes[1][2];
    if (shapes[1][0] != e || shapes[0][1] != (product == Product::kForward ? h : f)) {
      return kBadShape;
    }
  } else {
    h = shapes[0][1];
    f = shapes[1][1];
    if (shapes[1][0] != n_rows) return kBadShape;
  }
  const int out = 3;
  switch (product) {
    case Product::kForward:
      if (ndims[out] != 2 || shapes[out][0] != n_rows || shapes[out][1] != f) return kBadShape;
      break;
    case Product::kTransW:
      if (ndims[out] != 2 || shapes[out][0] != n_rows || shapes[out][1] != h) return kBadShape;
      break;
    case Product::kWeightGrad:
      if (ndims[out] != 3 || shapes[out][0] != e || shapes[out][1] != h || shapes[out][2] != f) {
        return kBadShape;
      }
      break;
  }
  std::vector<int64_t> off;
  if (!group_offsets(static_cast<const int32_t *>(params[2]), e, n_rows, &off)) {
    return kBadSizes;
  }
  if (ft == FloatType::kF32) {
    grouped(product, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
            static_cast<float *>(params[out]), off, n_rows, h, f);
    return kOk;
  }
  // float16: float32 scratch, one rounding at the end.
  const std::vector<float> a = to_float(static_cast<const _Float16 *>(params[0]),
                                        numel(ndims[0], shapes[0]));
  const std::vector<float> b = to_float(static_cast<const _Float16 *>(params[1]),
                                        numel(ndims[1], shapes[1]));
  std::vector<float> result(numel(ndims[out], shapes[out]));
  grouped(product, a.data(), b.data(), result.data(), off, n_rows, h, f);
  _Float16 *dst = static_cast<_Float16 *>(params[out]);
  for (size_t i = 0; i < result.size(); ++i) dst[i] = static_cast<_Float16>(result[i]);
  return kOk;
}

}  // namespace

extern "C" {

int MoeGroupedMatmul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                     void *stream, void *extra) {
  return entry(Product::kForward, nparam, params, ndims, shapes, dtypes);
}

int MoeGroupedMatmulTransW(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **dtypes, void *stream, void *extra) {
  return entry(Product::kTransW, nparam, params, ndims, shapes, dtypes);
}

int MoeGroupedMatmulWeightGrad(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  return entry(Product::kWeightGrad, nparam, params, ndims, shapes, dtypes);
}

void MoeGroupedMatmulSetThreads(int threads) {
#ifdef MOE_GMM_OPENBLAS
  scipy_openblas_set_num_threads(1);      // threads go to the tasks, see grouped()
  g_task_threads.store(threads);
#else
  g_threads.store(threads);
#endif
}

int MoeGroupedMatmulGetThreads() {
#ifdef MOE_GMM_OPENBLAS
  return task_threads();
#else
  return loop_threads();
#endif
}

const char *MoeGroupedMatmulBackend() {
#ifdef MOE_GMM_OPENBLAS
  return "openblas";
#else
  return "loop";
#endif
}

}  // extern "C"
