// Products of a few float32 rows by weight matrices, for decode steps on a CPU (see rowdot.py).
//
//   y[r, :] = x[r, :] @ W[ids[r]]      x [R, K], ids [R] int32, y [R, N]
//
// The weights are the call's remaining operands, each [K, N] or [G, K, N] (G matrices); their
// matrices are numbered in operand order and `ids` picks one per row. Rows that pick the same
// matrix are multiplied together, up to 8 at a time, so each matrix is read from memory once per
// 8 rows. The work is cut into items, each a row block and a range of W's rows (partial sums,
// added up at the end) or of its columns, that our helper threads and the calling thread take
// in turn. Each item streams its part of W row after row, two or four rows of W at a time, with
// the outputs accumulated in a small buffer.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int64_t kMaxRows = 8;    // rows multiplied together (the accumulators of a block)
constexpr int64_t kAccFloats = 4096;  // the accumulators of a block: 16 KiB, half of L1
constexpr int64_t kAlign = 16;
constexpr int64_t kAhead = 16;     // rows of w ahead that are prefetched     // column ranges start at multiples of one vector

// y[m, c0:c1] = x[m, :] @ w[:, c0:c1] for the block's M rows, U rows of w at a time (U x M
// broadcast inputs held in registers beside the loaded weights).
template <int M, int U = (M <= 4 ? 4 : 2)>
void Block(const float* const* xs, const float* w, int64_t k_dim, int64_t n_dim, int64_t c0,
           int64_t c1, float* const* ys) {
  constexpr int64_t kChunk = kAccFloats / M;  // columns accumulated at once
  // Each row's accumulators one vector further on than a power of two: loads and stores 4 KiB
  // apart would alias in the core's memory disambiguation and stall.
  constexpr int64_t kStride = kChunk + 16;
  alignas(64) float acc[M * kStride];
  for (int64_t cc = c0; cc < c1; cc += kChunk) {
    const int64_t nc = std::min(kChunk, c1 - cc);
    const int64_t nv = nc / 16 * 16;
    for (int m = 0; m < M; ++m) std::fill(acc + m * kStride, acc + m * kStride + nc, 0.0f);
    int64_t k = 0;
    for (; k + U <= k_dim; k += U) {
      const float* wu[U];
      v16 xb[U][M];
      for (int u = 0; u < U; ++u) {
        wu[u] = w + (k + u) * n_dim + cc;
        for (int m = 0; m < M; ++m) xb[u][m] = v16{} + xs[m][k + u];
      }
      for (int64_t j = 0; j < nv; j += 16) {
        v16 a[U];
        for (int u = 0; u < U; ++u) a[u] = load(wu[u] + j);
        for (int m = 0; m < M; ++m) {
          float* s = acc + m * kStride + j;
          v16 t = load(s);
          for (int u = 0; u < U; ++u) t += a[u] * xb[u][m];
          store(s, t);
        }
      }
      for (int64_t j = nv; j < nc; ++j) {
        for (int m = 0; m < M; ++m) {
          float t = acc[m * kStride + j];
          for (int u = 0; u < U; ++u) t += wu[u][j] * xs[m][k + u];
          acc[m * kStride + j] = t;
        }
      }
    }
    for (; k < k_dim; ++k) {
      const float* w0 = w + k * n_dim + cc;
      for (int m = 0; m < M; ++m) {
        const float xm = xs[m][k];
        for (int64_t j = 0; j < nc; ++j) acc[m * kStride + j] += w0[j] * xm;
      }
    }
    for (int m = 0; m < M; ++m) std::memcpy(ys[m] + cc, acc + m * kStride, nc * sizeof(float));
  }
}

using BlockFn = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t, int64_t,
                         float* const*);
constexpr BlockFn kBlocks[kMaxRows + 1] = {nullptr,  Block<1>, Block<2>, Block<3>, Block<4>,
                                           Block<5>, Block<6>, Block<7>, Block<8>};

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

struct Item {
  int64_t first;  // index into `order` of the block's first row
  int64_t rows;
  const float* w;
  int64_t c0, c1;  // the columns it computes
  int64_t k0, k1;  // the rows of w it reads
  int64_t part;    // 0: writes y; p > 0: a partial sum over its rows of w, into partials[p - 1]
};

struct Work {
  const float* x;
  float* y;
  int64_t k_dim, n_dim;
  std::vector<int64_t> order;  // row indices sorted by matrix
  std::vector<Item> items;
  mutable std::vector<float> partials;  // [parts - 1, R, N], added to y when every item is done
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run(const Item& it) const {
    const float* xs[kMaxRows];
    float* ys[kMaxRows];
    const int64_t r_dim = static_cast<int64_t>(order.size());
    float* out = it.part == 0 ? y : partials.data() + (it.part - 1) * r_dim * n_dim;
    for (int64_t m = 0; m < it.rows; ++m) {
      const int64_t r = order[it.first + m];
      xs[m] = x + r * k_dim + it.k0;
      ys[m] = out + r * n_dim;
    }
    kBlocks[it.rows](xs, it.w + it.k0 * n_dim, it.k1 - it.k0, n_dim, it.c0, it.c1, ys);
  }

  // Takes items until none is left.
  void Drain() {
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      Run(items[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Helper threads of our own (one fewer than the cores), woken for each call. After a call a
// helper spins for kSpin before it sleeps: a decode step's calls come tens of microseconds
// apart, and waking a sleeping thread (as XLA's intra-op pool's are between them) costs about
// as much as multiplying a 1 MiB matrix.
class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: its threads live as long
    return *helpers;
  }
  int64_t size() const { return static_cast<int64_t>(threads_.size()); }

  void Post(std::shared_ptr<Work> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(work);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(300);

  Helpers() {
    const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
    for (int64_t i = 0; i + 1 < cores; ++i) {
      threads_.emplace_back([this] { Loop(); });
      threads_.back().detach();
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until) {
        Pause();
      }
      std::shared_ptr<Work> work;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        seen = generation_.load(std::memory_order_acquire);
        work = job_;
      }
      if (work) work->Drain();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Work> job_;
};

// Below this many bytes of weights a call runs on the calling thread alone.
constexpr int64_t kParallelBytes = 256 * 1024;
// Column ranges are at least this wide, ranges of w's rows at least this long.
constexpr int64_t kMinColumns = 128;
constexpr int64_t kMinRows = 64;

ffi::Error RowDotImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                      ffi::RemainingArgs ws, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || ids.element_count() != xd[0] || yd[0] != xd[0]) {
    return ffi::Error::InvalidArgument("rowdot: x [R, K], ids [R] and y [R, N] expected");
  }
  const int64_t rows = xd[0], k_dim = xd[1], n_dim = yd[1];
  std::vector<const float*> mats;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value()) return w.error();
    const auto wd = w->dimensions();
    const int64_t g = wd.size() == 3 ? wd[0] : 1;
    if ((wd.size() != 2 && wd.size() != 3) || wd[wd.size() - 2] != k_dim ||
        wd[wd.size() - 1] != n_dim) {
      return ffi::Error::InvalidArgument("rowdot: every weight must be [K, N] or [G, K, N]");
    }
    for (int64_t j = 0; j < g; ++j) mats.push_back(w->typed_data() + j * k_dim * n_dim);
  }
  const int32_t* id = ids.typed_data();
  const int64_t n_mats = static_cast<int64_t>(mats.size());
  for (int64_t r = 0; r < rows; ++r) {
    if (id[r] < 0 || id[r] >= n_mats) {
      return ffi::Error::InvalidArgument("rowdot: a row's matrix id is out of range");
    }
  }

  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->y = y->typed_data();
  work->k_dim = k_dim;
  work->n_dim = n_dim;
  work->order.resize(rows);
  for (int64_t r = 0; r < rows; ++r) work->order[r] = r;
  std::stable_sort(work->order.begin(), work->order.end(),
                   [id](int64_t a, int64_t b) { return id[a] < id[b]; });

  // Row blocks: consecutive rows (in `order`) of one matrix, at most kMaxRows each.
  std::vector<Item> blocks;
  for (int64_t i = 0; i < rows;) {
    const int32_t m = id[work->order[i]];
    int64_t j = i;
    while (j < rows && j - i < kMaxRows && id[work->order[j]] == m) ++j;
    blocks.push_back(Item{i, j - i, mats[m], 0, n_dim, 0, k_dim, 0});
    i = j;
  }
  const int64_t threads = Helpers::Get().size() + 1;
  const int64_t bytes = static_cast<int64_t>(blocks.size()) * k_dim * n_dim * 4;
  const int64_t blocks_n = static_cast<int64_t>(blocks.size());
  // An item is a range of w's rows, read as one contiguous stretch, whose partial sums are
  // added up at the end: one per thread for blocks of 3 or more rows (their partial sums cost
  // more), about four per thread for 1-2 rows. Wide 1-2-row blocks (N x rows > kAccFloats)
  // are cut into column ranges instead.
  int64_t pieces = 1;
  bool by_rows = false;
  if (threads > 1 && bytes >= kParallelBytes) {
    int64_t widest = 0;
    for (const Item& b : blocks) widest = std::max(widest, b.rows);
    by_rows = widest > 2 || n_dim * widest <= kAccFloats;
    const int64_t per_thread = widest > 2 ? 1 : 4;
    const int64_t want = (per_thread * threads + blocks_n - 1) / blocks_n;
    const int64_t most = by_rows ? k_dim / kMinRows : n_dim / kMinColumns;
    pieces = std::max<int64_t>(1, std::min(want, most));
  }
  if (by_rows && pieces > 1) work->partials.assign((pieces - 1) * rows * n_dim, 0.0f);
  for (const Item& b : blocks) {
    int64_t lo = 0;
    const int64_t extent = by_rows ? k_dim : n_dim, step = by_rows ? 4 : kAlign;
    for (int64_t p = 0; p < pieces; ++p) {
      int64_t hi = p + 1 == pieces ? extent : (extent * (p + 1) / pieces) / step * step;
      if (hi > lo) {
        if (by_rows) {
          work->items.push_back(Item{b.first, b.rows, b.w, 0, n_dim, lo, hi, p});
        } else {
          work->items.push_back(Item{b.first, b.rows, b.w, lo, hi, 0, k_dim, 0});
        }
      }
      lo = std::max(lo, hi);
    }
  }
  const int64_t n_items = static_cast<int64_t>(work->items.size());
  if (n_items > 1) Helpers::Get().Post(work);
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < n_items) Pause();
  // Partial sums: every part but the first wrote all rows' outputs (zeros where a part had
  // fewer rows of w than others: every part covers every row block).
  float* out = work->y;
  const float* part = work->partials.data();
  for (size_t i = 0; i < work->partials.size(); ++i) out[i % (rows * n_dim)] += part[i];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertaxRowDot, RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());
