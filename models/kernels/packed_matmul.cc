// y[M, N] = x[M, K] @ W, for f32 weights stored in column panels: w[N / 32, K, 32], panel p holding columns
// 32p .. 32p+31. Built by models/cpu_kernels.py and called through XLA's FFI from models.llama on CPU.
//
// Why it exists: at 2-16 rows (a speculative verification pass) XLA:CPU's matmul kernels repack the whole
// weight matrix on every call, so a 9-token pass over SmolLM2 cost ~2x a 1-token step. A decoder's matmuls
// are bound by reading the weights once; this kernel streams each panel once, contiguously, and keeps all M
// rows' accumulators in registers, so 1-12 rows cost about the same as one.
//
// Every output element is one fused multiply-add chain over k = 0 .. K-1 in order, whatever M is and however
// the rows and panels are split over threads: a row's result does not depend on what else is in the call.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: two 16-float vectors
constexpr int kMaxRows = 12;    // rows per register tile: 2 * 12 accumulators + 2 weight vectors + 1 broadcast

typedef float vec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Rows [0, R) of x against one panel: acc[r] += x[r, k] * w[k, :] for k in order.
template <int R>
void tile(const float* __restrict x, int64_t k_dim, const float* __restrict panel, float* __restrict y,
          int64_t n_dim) {
  vec16 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = vec16{};
  for (int64_t k = 0; k < k_dim; ++k) {
    const vec16 w0 = load16(panel + k * kPanel), w1 = load16(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const vec16 xv = vec16{} + x[r * k_dim + k];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(y + r * n_dim, lo[r]);
    store16(y + r * n_dim + 16, hi[r]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTiles[kMaxRows] = {tile<1>, tile<2>, tile<3>, tile<4>,  tile<5>,  tile<6>,
                                     tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

// Panels [p0, p1) for all rows; the rows go in tiles of up to kMaxRows, so a panel comes from memory once
// and from cache for the later tiles.
void panels(const float* x, int64_t m_dim, int64_t k_dim, const float* w, float* y, int64_t n_dim, int64_t p0,
            int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * k_dim * kPanel;
    for (int64_t r0 = 0; r0 < m_dim; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m_dim - r0);
      kTiles[rows - 1](x + r0 * k_dim, k_dim, panel, y + r0 * n_dim + p * kPanel, n_dim);
    }
  }
}

// Work shared between the calling thread and helpers on XLA's intra-op pool. Chunks are claimed from a
// counter, and the caller waits only for chunks someone has claimed: a helper that starts late finds nothing
// left and returns, so the call never waits on a queued task (no deadlock when every pool thread is busy).
struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t m_dim, k_dim, n_dim, panels_per_chunk, n_panels, n_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) {
      const int64_t p0 = c * panels_per_chunk, p1 = std::min(n_panels, p0 + panels_per_chunk);
      panels(x, m_dim, k_dim, w, y, n_dim, p0, p1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel) {
    return ffi::Error::InvalidArgument("packed_matmul: expected x [M, K], w [N/32, K, 32], y [M, N]");
  }
  const int64_t m_dim = xd[0], k_dim = xd[1], n_panels = wd[0], n_dim = n_panels * kPanel;
  if (wd[1] != k_dim || yd[0] != m_dim || yd[1] != n_dim) {
    return ffi::Error::InvalidArgument("packed_matmul: x, w and y shapes disagree");
  }
  if (m_dim == 0 || n_panels == 0) return ffi::Error::Success();

  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(cores, pool.num_threads()));
  // Small matrices are not worth a helper: ~64 KB of weights is a few microseconds of reading.
  const bool parallel = workers > 1 && n_panels >= 4 && n_panels * k_dim * kPanel >= (1 << 14);
  if (!parallel) {
    panels(x.typed_data(), m_dim, k_dim, w.typed_data(), y->typed_data(), n_dim, 0, n_panels);
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->m_dim = m_dim;
  work->k_dim = k_dim;
  work->n_dim = n_dim;
  work->n_panels = n_panels;
  const int64_t target_chunks = std::min<int64_t>(n_panels, 4 * workers);
  work->panels_per_chunk = (n_panels + target_chunks - 1) / target_chunks;
  work->n_chunks = (n_panels + work->panels_per_chunk - 1) / work->panels_per_chunk;
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->n_chunks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPackedMatmulF32, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
