// CPU kernels for decode and verification passes, built by models/cpu_kernels.py and called through XLA's FFI
// from models.llama (the unstacked CPU decode layout).
//
// 1. Packed matmul: y[M, N] = x[M, K] @ W, for f32 weights stored in column panels w[N / 32, K, 32], panel p
//    holding columns 32p .. 32p+31. At 2-16 rows (a speculative verification pass) XLA:CPU's matmul kernels
//    repack the whole weight matrix on every call, so a 9-token pass over SmolLM2 cost ~2x a 1-token step.
//    A decoder's matmuls are bound by reading the weights once; this kernel streams each panel once,
//    contiguously, and keeps all rows' accumulators in registers, so (with AVX-512) 1-12 rows cost about
//    what one does. The register tile follows the vector width it is compiled for (below).
//    Every output element is one fused multiply-add chain over k = 0 .. K-1 in order, whatever M is and
//    however rows and panels are split over threads: a row's result does not depend on the rest of the call.
//
//    A bf16 variant reads panels of bfloat16 weights (half the bytes) and widens them to f32 in registers;
//    x, the accumulation and y stay f32. For draft heads, whose weights are read every draft step and whose
//    rounding only changes what they propose (a drafter's q is what it samples, so decoding stays lossless).
//
// 1b. RMSNorm fused into the matmul: y = (x / sqrt(mean(x^2) + eps) * scale) @ W, the normalisation as
//    models.llama.RMSNorm computes it in f32 (x times the reciprocal root, then the scale). At a 9-token call
//    XLA:CPU ran each norm as three small ops (a YNNPACK reduction, the root, the product) of ~15-25 us each,
//    ~1 ms of a SmolLM2 call for its 61 norms; here it is one pass over M x K floats before the product.
//
// 2. Cache attention: softmax(q K^T * scale + mask) V for the T query tokens of a call against one layer of
//    the stacked cache [L, B, Hkv, S, D], read in place. XLA:CPU copied each layer's K and V slice out of the
//    cache and ran the few-row attention as a handful of library calls with ~15-50 us of fixed cost each
//    (about 2 ms of a 1-token step, 7 ms of a 9-token one). Native-width vectors only (vecn, one query row per
//    lane): 16-float vector types on AVX2 compiled to code that went through the stack (~8x slower).

#include <algorithm>
#include <cmath>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per panel (the packing is the same on every CPU)

// The matmul's register tile is sized for the CPU it is compiled for (-march=native): R rows x 2 native
// vectors of accumulators, plus 2 weight vectors and 1 broadcast, must fit the register file, or the
// accumulators spill and every multiply-add goes through memory. AVX-512 (32 x 16 floats): the whole
// 32-column panel, 12 rows. AVX2 (16 x 8 floats): 16 columns, 6 rows; the panel's other half is a second
// pass that finds it in cache. 128-bit NEON (32 x 4 floats): 8 columns, 12 rows, four passes.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kMaxRows = 12;
#elif defined(__AVX2__) || defined(__AVX__)
constexpr int kLanes = 8, kMaxRows = 6;
#elif defined(__aarch64__)
constexpr int kLanes = 4, kMaxRows = 12;
#else
constexpr int kLanes = 4, kMaxRows = 6;
#endif
constexpr int64_t kChunk = 2 * kLanes;  // panel columns per pass
static_assert(kPanel % kChunk == 0, "a panel splits into whole passes");

typedef float vecn __attribute__((vector_size(4 * kLanes)));
typedef uint16_t u16n __attribute__((vector_size(2 * kLanes)));
typedef uint32_t u32n __attribute__((vector_size(4 * kLanes)));

inline vecn loadn(const float* p) {
  vecn v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes bfloat16 (the high halves of f32s) widened to f32: exact.
inline vecn loadn(const uint16_t* p) {
  u16n h;
  std::memcpy(&h, p, sizeof(h));
  const u32n w = __builtin_convertvector(h, u32n) << 16;
  vecn v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline void storen(float* p, vecn v) { std::memcpy(p, &v, sizeof(v)); }

// s in every lane. Written as s - 0, which is exact for every s, so the compiler loads it straight into a
// vector (one broadcast from memory, no ALU work). The obvious 0 + s is not exact for s = -0, so it kept a
// scalar add and a register broadcast per row: two more uops per row on the ports the multiply-adds need,
// which cost ~40% of the kernel's arithmetic rate (12-row tiles: ~130 -> ~230 GFLOP/s on 2 Xeon cores).
template <typename V>
inline V splat(float s) {
  return s - V{};
}

// Software prefetch: how far ahead the first pass reads (rows of the panel stream, which runs on into the next
// panel) and the locality hint. Whole-panel tiles (AVX-512): 192 rows with prefetcht2, measured on an Intel
// Xeon (Emerald Rapids): a 9-token SmolLM2 call fell from ~1.7x to ~1.3x a 1-token one, which got faster too
// (GCC's locality 1 is prefetcht2); without it the hardware prefetcher lets a tile of many rows wait on memory
// between its multiply-adds.
// Split panels (AVX2, NEON): 96 rows into L1, measured on a Zen 3.
#if defined(__AVX512F__)
constexpr int64_t kAhead = 192;
constexpr int kLocality = 1;
#else
constexpr int64_t kAhead = 96;
constexpr int kLocality = 3;
#endif

// Rows [0, R) of x against columns [c0, c0 + NV * kLanes) of one panel: acc[r] += x[r, k] * w[k, :] for k in
// order. pf: rows to prefetch alongside (row k of pf at step k), or null.
template <int R, int NV, typename W>
void tile(const float* __restrict x, int64_t k_dim, const W* __restrict panel, int64_t c0, float* __restrict y,
          int64_t n_dim, const W* pf) {
  vecn acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = vecn{};
  for (int64_t k = 0; k < k_dim; ++k) {
    const W* wk = panel + k * kPanel + c0;
    if (pf != nullptr) {
      const char* row = reinterpret_cast<const char*>(pf + k * kPanel);
      for (int64_t b = 0; b < kPanel * int64_t(sizeof(W)); b += 64) __builtin_prefetch(row + b, 0, kLocality);
    }
    vecn wv[NV];
    for (int i = 0; i < NV; ++i) wv[i] = loadn(wk + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const vecn xv = splat<vecn>(x[r * k_dim + k]);
      for (int i = 0; i < NV; ++i) acc[r][i] += xv * wv[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) storen(y + r * n_dim + c0 + i * kLanes, acc[r][i]);
}

template <typename W, int NV, int... R>
struct TileTable {
  using Fn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, const W*);
  static constexpr Fn fns[sizeof...(R)] = {tile<R, NV, W>...};
};

// Tiles of up to kMaxRows rows, 2 vectors wide; and for 1-3 rows, tiles as wide as the panel where that
// fits the registers (AVX2: 4 x 8 floats), so a decode step (or a K=2 verification) reads each panel in one
// contiguous pass.
template <typename W>
using Tiles = std::conditional_t<kMaxRows == 12, TileTable<W, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>,
                                 TileTable<W, 2, 1, 2, 3, 4, 5, 6>>;
static_assert(kMaxRows == 12 || kMaxRows == 6, "one tile table per row budget");
constexpr int kWideVectors = kPanel / kLanes;  // one pass over the whole panel
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif
// Rows (up to 2) whose whole-panel tile fits: R * NV accumulators + NV weights + 1 broadcast. 0 where the
// regular tile is already the whole panel (AVX-512), or where not even one row fits (SSE: 8 + 8 + 1 > 16).
constexpr int kWideRows = kWideVectors == 2                                 ? 0
                          : 2 * kWideVectors + kWideVectors + 1 <= kRegisters ? 2
                          : kWideVectors + kWideVectors + 1 <= kRegisters     ? 1
                                                                              : 0;
// On AVX2 a third row fits if the weights are not held in registers: 12 accumulators + 1 broadcast, each
// multiply-add reading its weight vector from memory (GCC folds the loads). A 3-token call (a K=2 chain's
// verification) then streams each panel once instead of in two half-panel passes: its products over
// SmolLM2's weights took 3-6% less time on a Zen 3 (2 threads, 21 alternated runs each, three times).
// Other targets keep kWideRows (not measured there), and so do bf16 panels: widened to f32 they must sit in
// registers, and the 3-row tile then spills an accumulator through the stack on every step.
template <typename W>
constexpr int kWideMax =
    std::is_same_v<W, float> && kWideRows == 2 && kLanes == 8 && kRegisters == 16 ? 3 : kWideRows;
template <typename W>
using WideTiles = TileTable<W, kWideVectors, 1, 2, 3>;

// Panels [p0, p1) for all rows; the rows go in tiles of up to kMaxRows. A panel comes from memory once, in
// the first tile, and from cache for the later tiles and passes. The first tile prefetches kAhead rows ahead
// (when it reads only part of each row, the later passes need the rest: strided reads alone stall on memory),
// and the later tiles prefetch the next panel, so its memory traffic overlaps their arithmetic.
template <typename W>
void panels(const float* x, int64_t m_dim, int64_t k_dim, const W* w, float* y, int64_t n_dim, int64_t p0,
            int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = w + p * k_dim * kPanel;
    const W* next = p + 1 < p1 ? panel + k_dim * kPanel : nullptr;
    if (m_dim <= kWideMax<W>) {
      WideTiles<W>::fns[m_dim - 1](x, k_dim, panel, 0, y + p * kPanel, n_dim, nullptr);
      continue;
    }
    for (int64_t c0 = 0; c0 < kPanel; c0 += kChunk) {
      for (int64_t r0 = 0; r0 < m_dim; r0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, m_dim - r0);
        const bool first = c0 == 0 && r0 == 0;
        const W* pf = first ? panel + kAhead * kPanel : next;
        Tiles<W>::fns[rows - 1](x + r0 * k_dim, k_dim, panel, c0, y + r0 * n_dim + p * kPanel, n_dim, pf);
      }
    }
  }
}

// Runs fn(item) for item in [0, n_items) on the calling thread and helpers from XLA's intra-op pool. Items
// are claimed from a counter, and the caller waits only for items someone has claimed: a helper that starts
// late finds nothing left and returns, so the call never waits on a queued task (no deadlock when every pool
// thread is busy).
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n_items, int64_t workers, Fn fn) {
  struct Shared {
    Fn fn;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void run() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  workers = std::min(workers, n_items);
  if (workers <= 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(i);
    return;
  }
  std::shared_ptr<Shared> shared(new Shared{fn, n_items});
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([shared] { shared->run(); });
  shared->run();
  while (shared->done.load(std::memory_order_acquire) < n_items) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

int64_t workers_for(ffi::ThreadPool& pool) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min<int64_t>(cores, pool.num_threads()));
}

// y = x @ W over panels [0, n_panels) of w, split over the pool's threads.
template <typename W>
void matmul_rows(ffi::ThreadPool& pool, const float* xp, int64_t m_dim, int64_t k_dim, const W* wp, float* yp,
                 int64_t n_panels) {
  const int64_t n_dim = n_panels * kPanel;
  const int64_t workers = workers_for(pool);
  // Small matrices are not worth a helper: ~64 KB of weights is a few microseconds of reading.
  const bool parallel = workers > 1 && n_panels >= 4 && n_panels * k_dim * kPanel >= (1 << 14);
  const int64_t n_chunks = parallel ? std::min<int64_t>(n_panels, 4 * workers) : 1;
  const int64_t per_chunk = (n_panels + n_chunks - 1) / n_chunks;
  parallel_for(pool, (n_panels + per_chunk - 1) / per_chunk, parallel ? workers : 1, [=](int64_t c) {
    panels(xp, m_dim, k_dim, wp, yp, n_dim, c * per_chunk, std::min(n_panels, (c + 1) * per_chunk));
  });
}

template <ffi::DataType WT>
ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel) {
    return ffi::Error::InvalidArgument("packed_matmul: expected x [M, K], w [N/32, K, 32], y [M, N]");
  }
  const int64_t m_dim = xd[0], k_dim = xd[1], n_panels = wd[0];
  if (wd[1] != k_dim || yd[0] != m_dim || yd[1] != n_panels * kPanel) {
    return ffi::Error::InvalidArgument("packed_matmul: x, w and y shapes disagree");
  }
  if (m_dim == 0 || n_panels == 0) return ffi::Error::Success();
  matmul_rows(pool, x.typed_data(), m_dim, k_dim, w.typed_data(), y->typed_data(), n_panels);
  return ffi::Error::Success();
}

// RMSNorm fused into the matmul (1b above). The sum of squares runs in a fixed order (kLanes partial sums over
// k, then the lanes in order), so a row's result does not depend on the rest of the call either.
void rms_norm_rows(const float* x, const float* scale, float eps, int64_t m_dim, int64_t k_dim, float* xn) {
  for (int64_t r = 0; r < m_dim; ++r) {
    const float* xr = x + r * k_dim;
    float* out = xn + r * k_dim;
    vecn acc = vecn{};
    int64_t k = 0;
    for (; k + kLanes <= k_dim; k += kLanes) {
      const vecn v = loadn(xr + k);
      acc += v * v;
    }
    float lanes[kLanes];
    storen(lanes, acc);
    float ss = 0.0f;
    for (int i = 0; i < kLanes; ++i) ss += lanes[i];
    for (; k < k_dim; ++k) ss += xr[k] * xr[k];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(k_dim) + eps);
    for (k = 0; k < k_dim; ++k) out[k] = (xr[k] * inv) * scale[k];
  }
}

template <ffi::DataType WT>
ffi::Error NormMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<WT> w, ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions(), sd = scale.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || sd.size() != 1 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel) {
    return ffi::Error::InvalidArgument("norm_matmul: expected x [M, K], scale [K], w [N/32, K, 32], y [M, N]");
  }
  const int64_t m_dim = xd[0], k_dim = xd[1], n_panels = wd[0];
  if (sd[0] != k_dim || wd[1] != k_dim || yd[0] != m_dim || yd[1] != n_panels * kPanel) {
    return ffi::Error::InvalidArgument("norm_matmul: x, scale, w and y shapes disagree");
  }
  if (m_dim == 0 || n_panels == 0) return ffi::Error::Success();
  // The caller's buffer: the helpers read it while the caller waits for them.
  thread_local std::vector<float> xn;
  if (xn.size() < static_cast<size_t>(m_dim * k_dim)) xn.resize(m_dim * k_dim);
  rms_norm_rows(x.typed_data(), scale.typed_data(), eps, m_dim, k_dim, xn.data());
  matmul_rows(pool, xn.data(), m_dim, k_dim, w.typed_data(), y->typed_data(), n_panels);
  return ffi::Error::Success();
}

// ---- Cache attention -------------------------------------------------------------------------------------

typedef int32_t ivecn __attribute__((vector_size(4 * kLanes)));

// e^x for x <= 0, ~1 ulp (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r);
// e^x = 0 below -87 (masked scores sit at -1e30 below the row's maximum).
inline vecn exp_nonpositive(vecn x) {
  const vecn zero = vecn{};
  const ivecn tiny = x < -87.0f;
  x = tiny ? zero - 87.0f : x;
  vecn y = x * 1.44269504088896341f + 0.5f;
  vecn n = __builtin_convertvector(__builtin_convertvector(y, ivecn), vecn);  // truncates toward zero
  n = (n > y) ? n - 1.0f : n;  // floor
  const vecn r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vecn p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivecn bits = (__builtin_convertvector(n, ivecn) + 127) << 23;
  vecn scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? zero : p * scale;
}

constexpr int kRows = kLanes;       // query rows per work item: one per lane of a native vector
constexpr float kMaskValue = -1e30f;  // as models.llama._MASK_VALUE: a row with no visible slot is uniform

// out_r += sum_j p[j][r] * V_j for RB rows at a time (RB * NV accumulators stay in registers). Every tile reads
// all RB rows' weights, also past the block's last lane (those accumulators are dropped): up to RB - 1 floats
// past p[s_dim - 1][kRows - 1] (AVX-512, RB = 12: the second tile reads lanes 12-23), so p needs kScoresSlack
// floats after its s_dim * kRows (they are never written; what they hold does not reach the output).
constexpr int64_t kScoresSlack = kRows;
template <int NV, int RB>
void weighted_values(const float* p, int lanes, int64_t s_dim, const float* v, float* out[kRows]) {
  static_assert(RB >= 1 && RB - 1 <= kScoresSlack, "a tile's reads past the last lane stay in the slack");
  for (int r0 = 0; r0 < lanes; r0 += RB) {
    const int rb = std::min(RB, lanes - r0);
    vecn acc[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < NV; ++i) acc[r][i] = vecn{};
    for (int64_t j = 0; j < s_dim; ++j) {
      vecn vj[NV];
      for (int i = 0; i < NV; ++i) vj[i] = loadn(v + (j * NV + i) * kLanes);
      for (int r = 0; r < RB; ++r) {
        const vecn pr = splat<vecn>(p[j * kRows + r0 + r]);
        for (int i = 0; i < NV; ++i) acc[r][i] += pr * vj[i];
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int i = 0; i < NV; ++i) storen(out[r0 + r] + i * kLanes, acc[r][i]);
  }
}

// The index of the last nonzero byte of m[0, n), -1 if none: memrchr(m, 1, n) for a PRED row (each byte 0 or 1),
// which is a GNU extension (macOS has none). 256 bytes at a time while they are all zero (a serving cache's mask
// is mostly zeros past the visible slots; GCC ORs them as vectors), then 8, then byte by byte inside the word
// that holds the last one. Within ~0.04 us of glibc's memrchr per block of 16 rows up to 2048 slots (a Xeon,
// AVX-512 and AVX2 builds alike); a word load per array element: one memcpy of the block went through the stack.
inline int64_t last_nonzero(const bool* m, int64_t n) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(m);
  int64_t i = n;
  for (; i >= 256; i -= 256) {
    uint64_t any = 0;
    for (int k = 0; k < 32; ++k) {
      uint64_t w;
      std::memcpy(&w, b + i - 256 + 8 * k, sizeof(w));
      any |= w;
    }
    if (any != 0) break;
  }
  for (; i >= 8; i -= 8) {
    uint64_t w;
    std::memcpy(&w, b + i - 8, sizeof(w));
    if (w != 0) break;
  }
  if (i >= 8) {  // the word ending at i holds a nonzero byte
    int64_t k = i - 1;
    while (b[k] == 0) --k;
    return k;
  }
  while (i > 0 && b[i - 1] == 0) --i;
  return i - 1;
}

// One (batch row, KV head, block of up to kRows query rows). Query row r of the block is (token t, head g) with
// r + first = t * G + g. Lanes of a vector are query rows: scores[j] holds slot j's score for every row.
template <int NV>
void attend_block(const float* q, const float* k, const float* v, const bool* mask, float* out, int64_t t_dim,
                  int64_t h_dim, int64_t groups, int64_t s_dim, int64_t kvh, int64_t first, int lanes, float scale,
                  float* scores) {
  constexpr int64_t d_dim = NV * kLanes;
  // Q^T: qt[d] lane r = q[row r][d].
  vecn qt[d_dim];
  const float* qrow[kRows];
  const bool* mrow[kRows];
  float* orow[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t rr = first + std::min(r, lanes - 1), t = rr / groups, h = kvh * groups + rr % groups;
    qrow[r] = q + (t * h_dim + h) * d_dim;
    mrow[r] = mask + t * s_dim;
    orow[r] = out + (t * h_dim + h) * d_dim;
  }
  for (int64_t d = 0; d < d_dim; ++d) {
    float lane[kRows];
    for (int r = 0; r < kRows; ++r) lane[r] = qrow[r][d] * scale;
    qt[d] = loadn(lane);
  }
  // Slots past the last visible one of every row add exactly 0 (e^(-1e30 - max) underflows), so stop there:
  // a serving cache is sized for the longest request and mostly empty. A row with no visible slot at all is
  // uniform over all S slots, as in the XLA path, so then every slot is read.
  // A row is a prefix when every slot up to its last visible one is visible (plain steps, chain verifications,
  // prefills; not tree masks): then the mask is one vector compare per slot instead of a select per lane.
  // Both searches are byte scans (a PRED element is one byte, 0 or 1). Slot indices are int32 lanes: the
  // caller refuses S >= 2^31.
  int64_t limit = 0;
  bool prefix = true;
  int32_t last_row[kRows];
  for (int r = 0; r < kRows; ++r) {
    const bool* m = mrow[r];
    const int64_t last = last_nonzero(m, s_dim);
    if (last < 0) {
      limit = s_dim;
      prefix = false;
      break;
    }
    limit = std::max(limit, last + 1);
    prefix = prefix && std::memchr(m, 0, last + 1) == nullptr;
    last_row[r] = static_cast<int32_t>(last);
  }
  s_dim = limit;
  // Scores, 8 slots at a time: 8 independent multiply-add chains (4 left the chains' latency exposed). The cache
  // comes from memory (the call's weights have evicted it), so K is fetched 32 slots ahead and V, read by the
  // weighted sum below, alongside. With the vector mask and a per-thread scores buffer (a fresh zero-filled
  // one per block cost ~2 us), SmolLM2 calls at 300 cached tokens took ~0.5-0.7 ms less (1 and 9 tokens alike,
  // of ~18 ms; a 2-core Zen 4, calls alternated in one process).
  vecn mx = vecn{} + kMaskValue;
  int64_t j = 0;
  for (; j + 8 <= s_dim; j += 8) {
    vecn a[8] = {};
    const float* kj = k + j * d_dim;
    for (int64_t b = 0; b < 8 * d_dim; b += 16) {  // one cache line per prefetch
      __builtin_prefetch(kj + 32 * d_dim + b, 0, 3);
      __builtin_prefetch(v + j * d_dim + b, 0, 2);
    }
    for (int64_t d = 0; d < d_dim; ++d) {
      const vecn qd = qt[d];
      for (int i = 0; i < 8; ++i) a[i] += kj[i * d_dim + d] * qd;
    }
    for (int i = 0; i < 8; ++i) storen(scores + (j + i) * kRows, a[i]);
  }
  for (; j < s_dim; ++j) {
    vecn a0{};
    for (int64_t d = 0; d < d_dim; ++d) a0 += k[j * d_dim + d] * qt[d];
    storen(scores + j * kRows, a0);
  }
  if (prefix) {
    ivecn lastv, jv = ivecn{};
    std::memcpy(&lastv, last_row, sizeof(lastv));
    for (j = 0; j < s_dim; ++j, jv += 1) {
      const vecn sv = jv <= lastv ? loadn(scores + j * kRows) : vecn{} + kMaskValue;
      storen(scores + j * kRows, sv);
      mx = sv > mx ? sv : mx;
    }
  } else {
    for (j = 0; j < s_dim; ++j) {
      float* sj = scores + j * kRows;
      for (int r = 0; r < kRows; ++r) sj[r] = mrow[r][j] ? sj[r] : kMaskValue;
      const vecn sv = loadn(sj);
      mx = sv > mx ? sv : mx;
    }
  }
  // Softmax numerators and their sum, per lane.
  vecn sum{};
  for (j = 0; j < s_dim; ++j) {
    const vecn e = exp_nonpositive(loadn(scores + j * kRows) - mx);
    storen(scores + j * kRows, e);
    sum += e;
  }
  float acc_rows[kRows][d_dim];
  float* accp[kRows];
  for (int r = 0; r < kRows; ++r) accp[r] = acc_rows[r];
  // RB * NV accumulators in registers. AVX-512 (32 registers): 24 / NV rows. Otherwise (16 registers) the NV
  // value vectors, one broadcast and RB * NV accumulators must fit; at one row the value vectors need no
  // registers of their own (the multiply-adds read them from memory).
  constexpr int kRb = kLanes == 16 ? (NV >= 8 ? 3 : 24 / NV) : std::max(1, (16 - 1 - NV) / NV);
  static_assert(kRb <= kRows, "a row tile is at most one block");
  weighted_values<NV, kRb>(scores, lanes, s_dim, v, accp);
  float inv[kRows];
  storen(inv, 1.0f / sum);
  for (int r = 0; r < lanes; ++r)
    for (int64_t d = 0; d < d_dim; ++d) orow[r][d] = acc_rows[r][d] * inv[r];
}

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
                              ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::PRED> mask,
                              ffi::ResultBuffer<ffi::F32> out, int64_t layer, float scale) {
  // q, out [B, T, H, D]; k_all, v_all [L, B, Hkv, S, D]; mask [B, T, S].
  const auto qd = q.dimensions(), kd = k_all.dimensions(), md = mask.dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (qd.size() != 4 || kd.size() != 5 || md.size() != 3 || !same(v_all.dimensions(), kd) ||
      !same(out->dimensions(), qd)) {
    return ffi::Error::InvalidArgument("cache_attention: expected q [B,T,H,D], k/v [L,B,Hkv,S,D], mask [B,T,S]");
  }
  const int64_t b_dim = qd[0], t_dim = qd[1], h_dim = qd[2], d_dim = qd[3];
  const int64_t l_dim = kd[0], hkv = kd[2], s_dim = kd[3];
  if (kd[1] != b_dim || kd[4] != d_dim || md[0] != b_dim || md[1] != t_dim || md[2] != s_dim ||
      hkv == 0 || h_dim % hkv != 0 || layer < 0 || layer >= l_dim) {
    return ffi::Error::InvalidArgument("cache_attention: q, k/v, mask shapes or the layer index disagree");
  }
  if (d_dim != 32 && d_dim != 64 && d_dim != 128) {
    return ffi::Error::InvalidArgument("cache_attention: head dim must be 32, 64 or 128");
  }
  if (s_dim > INT32_MAX) {  // slot indices are compared as int32 lanes
    return ffi::Error::InvalidArgument("cache_attention: S must be below 2^31 slots");
  }
  const int64_t groups = h_dim / hkv, rows = t_dim * groups, blocks = (rows + kRows - 1) / kRows;
  const float* qp = q.typed_data();
  const float* kp = k_all.typed_data() + layer * b_dim * hkv * s_dim * d_dim;
  const float* vp = v_all.typed_data() + layer * b_dim * hkv * s_dim * d_dim;
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  const int64_t items = b_dim * hkv * blocks;
  parallel_for(pool, items, workers_for(pool), [=](int64_t item) {
    const int64_t blk = item % blocks, kvh = (item / blocks) % hkv, b = item / (blocks * hkv);
    const int lanes = static_cast<int>(std::min<int64_t>(kRows, rows - blk * kRows));
    // Slot j's scores at [j * kRows, (j + 1) * kRows), then kScoresSlack floats that weighted_values reads past
    // the last slot (their values never reach the output).
    thread_local std::vector<float> scores;
    const size_t n_scores = static_cast<size_t>(s_dim * kRows + kScoresSlack);
    if (scores.size() < n_scores) scores.resize(n_scores);
    const float* qb = qp + b * t_dim * h_dim * d_dim;
    const float* kb = kp + (b * hkv + kvh) * s_dim * d_dim;
    const float* vb = vp + (b * hkv + kvh) * s_dim * d_dim;
    const bool* mb = mp + b * t_dim * s_dim;
    float* ob = op + b * t_dim * h_dim * d_dim;
    const int64_t first = blk * kRows;
    // NV = head dim / lanes native vectors per row of K and V.
    if (d_dim == 32) {
      attend_block<32 / kLanes>(qb, kb, vb, mb, ob, t_dim, h_dim, groups, s_dim, kvh, first, lanes, scale,
                                scores.data());
    } else if (d_dim == 64) {
      attend_block<64 / kLanes>(qb, kb, vb, mb, ob, t_dim, h_dim, groups, s_dim, kvh, first, lanes, scale,
                                scores.data());
    } else {
      attend_block<128 / kLanes>(qb, kb, vb, mb, ob, t_dim, h_dim, groups, s_dim, kvh, first, lanes, scale,
                                 scores.data());
    }
  });
  return ffi::Error::Success();
}

// ---- Row argmax ------------------------------------------------------------------------------------------

// Rows are split into chunks at multiples of kArgmaxChunk columns (never where the call's work happens to
// split), each chunk's (maximum, its first index, whether it holds a NaN) found with vector compares, then
// merged in column order: a row's id does not depend on the rest of the call.
constexpr int64_t kArgmaxChunk = 8192;

struct ArgmaxPart {
  float best;
  int32_t index;
  bool nan;
};

ArgmaxPart argmax_chunk(const float* x, int64_t j0, int64_t j1) {
  ArgmaxPart part{x[j0], static_cast<int32_t>(j0), x[j0] != x[j0]};
  int64_t j = j0 + 1;
  // Independent compare/select chains: with one, each step waited on the last ([9, 49152]: 62-66 against
  // 31-33 us on a 2-core Zen 5).
  constexpr int kChains = 4;
  if (j1 - j0 >= kChains * kLanes) {
    // Chain c, lane l keeps the first index of its own maximum over the vectors it reads (strict >: a later
    // equal value does not replace it); the merge then takes the lowest index among equal maxima.
    vecn best[kChains];
    ivecn idx[kChains], at[kChains], nan = ivecn{};
    for (int c = 0; c < kChains; ++c) {
      best[c] = loadn(x + j0 + c * kLanes);
      for (int l = 0; l < kLanes; ++l) idx[c][l] = static_cast<int32_t>(j0 + c * kLanes + l);
      at[c] = idx[c];
      nan |= best[c] != best[c];
    }
    for (j = j0 + kChains * kLanes; j + kChains * kLanes <= j1; j += kChains * kLanes) {
      for (int c = 0; c < kChains; ++c) {
        const vecn v = loadn(x + j + c * kLanes);
        at[c] += kChains * kLanes;
        const ivecn gt = v > best[c];
        best[c] = gt ? v : best[c];
        idx[c] = gt ? at[c] : idx[c];
        nan |= v != v;
      }
    }
    part = {best[0][0], idx[0][0], false};
    for (int c = 0; c < kChains; ++c) {
      for (int l = 0; l < kLanes; ++l) {
        part.nan = part.nan || nan[l] != 0;
        const float b = best[c][l];
        if (b > part.best || (b == part.best && idx[c][l] < part.index)) part = {b, idx[c][l], part.nan};
      }
    }
  }
  for (; j < j1; ++j) {
    part.nan = part.nan || x[j] != x[j];
    if (x[j] > part.best) part = {x[j], static_cast<int32_t>(j), part.nan};
  }
  return part;
}

// 3. Row argmax: ids[m] = the lowest index of the maximum of x[m, :], and V - 1 for a row holding a NaN (the
//    contract of jspec.sampling.argmax, which the decoder's greedy paths used before). XLA:CPU's max, compare
//    and min passes over a 9-token call's [9, 49152] logits took ~0.3 ms of a verification round.
ffi::Error RowArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> ids) {
  const auto xd = x.dimensions(), od = ids->dimensions();
  if (xd.size() != 2 || od.size() != 1 || od[0] != xd[0]) {
    return ffi::Error::InvalidArgument("row_argmax: expected x [M, V] and ids [M]");
  }
  const int64_t m_dim = xd[0], v_dim = xd[1];
  if (m_dim == 0) return ffi::Error::Success();
  if (v_dim == 0 || v_dim > INT32_MAX) return ffi::Error::InvalidArgument("row_argmax: V must be in [1, 2^31)");
  const int64_t chunks = (v_dim + kArgmaxChunk - 1) / kArgmaxChunk;
  std::vector<ArgmaxPart> parts(m_dim * chunks);
  const float* xp = x.typed_data();
  ArgmaxPart* pp = parts.data();
  const int64_t items = m_dim * chunks;
  // One thread up to a few MB of logits: they were just written by the LM head's threads, and a second
  // reader made a 9-token call's [9, 49152] slower (82 against 52 us on a 2-core Zen 5).
  const bool parallel = m_dim * v_dim >= (int64_t(1) << 22);
  parallel_for(pool, items, parallel ? workers_for(pool) : 1, [=](int64_t item) {
    const int64_t r = item / chunks, c = item % chunks;
    const int64_t j0 = c * kArgmaxChunk, j1 = std::min(v_dim, j0 + kArgmaxChunk);
    pp[item] = argmax_chunk(xp + r * v_dim, j0, j1);
  });
  int32_t* out = ids->typed_data();
  for (int64_t r = 0; r < m_dim; ++r) {
    ArgmaxPart row = parts[r * chunks];
    for (int64_t c = 1; c < chunks; ++c) {
      const ArgmaxPart& p = parts[r * chunks + c];
      row.nan = row.nan || p.nan;
      if (p.best > row.best) row = {p.best, p.index, row.nan};
    }
    out[r] = row.nan ? static_cast<int32_t>(v_dim - 1) : row.index;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecCacheAttentionF32, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPackedMatmulF32, PackedMatmulImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPackedMatmulBF16, PackedMatmulImpl<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecNormMatmulF32, NormMatmulImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecNormMatmulBF16, NormMatmulImpl<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecRowArgmaxF32, RowArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
