// One helper thread that shares small pieces of work with the calling thread, for decode steps whose
// products are too short to pay for waking an OpenMP worker.
//
// Why not OpenMP: under OMP_WAIT_POLICY=PASSIVE (which shared cores need: spinning OpenMP workers wait
// for each other's time slices) a parallel region wakes its sleeping worker through the kernel, 50-150 us
// on a 2-core VM, and the region's static split then makes the caller wait for the worker's half. A
// decode step's bf16 products take ~130 us on one core, so they ran on one core and the second idled.
//
// Here the work is cut into pieces that either thread claims from one atomic ticket: the caller never
// waits for a helper that has not started (it takes the unclaimed pieces itself), only for a piece the
// helper already holds. After its last piece the helper spins, yielding its core at each turn, for
// KVLEDGER_HELPER_SPIN_US (default 1000 us: a decode layer's gaps between products, attention included),
// then sleeps on a condition variable; the caller wakes it, without waiting, when it publishes work.
// So within a step the helper is awake, between steps it sleeps, and on a busy machine a descheduled
// helper costs the caller nothing but the pieces it would have done. A yield that returns late (another
// thread held the core) ends the spin at once: on a contended core the helper sleeps between pieces, and the
// scheduler runs a woken sleeper promptly where it would deschedule a spinner mid-piece. Both threads run
// their pieces with one OpenMP thread. Results do not depend on which thread ran a piece.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace kvl_pool {

class Helper {
 public:
  static Helper& get() {
    static Helper* h = new Helper();  // never destroyed: the thread is detached, exit need not join it
    return *h;
  }

  // fn(i) for every i in [0, n), on the calling thread and the helper; returns when all are done and
  // rethrows the first exception a piece raised.
  void run(int n, const std::function<void(int)>& fn) {
    if (n <= 0) return;
    if (n == 1 || !enabled_) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    ensure_started();
    fn_ = &fn;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    epoch_ = (epoch_ + 1) & 0xffffffffu;
    ticket_.store((epoch_ << 32) | (static_cast<uint64_t>(n) << 16), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_one();
    }
    int idx;
    while (claim(idx)) piece(idx);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        sched_yield();  // the helper holds a piece but has lost its core
      }
    }
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  void set_enabled(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  int64_t pieces_by_helper() const { return by_helper_.load(std::memory_order_relaxed); }

 private:
  Helper() {
    const char* s = std::getenv("KVLEDGER_HELPER_SPIN_US");
    spin_ns_ = (s && *s ? std::atoll(s) : 1000) * 1000;
    if (spin_ns_ < 0) spin_ns_ = 0;
    pthread_atfork(nullptr, nullptr, [] { get().started_ = false; });  // a forked child has no helper
  }

  void ensure_started() {
    if (started_) return;
    started_ = true;
    sleeping_.store(false);
    std::thread([this] { loop(); }).detach();
  }

  // Take the next unclaimed piece of the current work, if any (the epoch in the ticket ties the claim to it).
  bool claim(int& idx) {
    uint64_t cur = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = cur & 0xffff, n = (cur >> 16) & 0xffff;
      if (next >= n) return false;
      if (ticket_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        idx = static_cast<int>(next);
        return true;
      }
    }
  }

  bool has_work() const {
    const uint64_t cur = ticket_.load(std::memory_order_seq_cst);
    return (cur & 0xffff) < ((cur >> 16) & 0xffff);
  }

  void piece(int idx) {
    try {
      (*fn_)(idx);
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
  }

  void loop() {
    omp_set_num_threads(1);  // this thread's own OpenMP setting: its pieces run inline
    c10::InferenceMode guard;  // writes into the caller's inference tensors are allowed
    using clock = std::chrono::steady_clock;
    auto last = clock::now();
    for (;;) {
      int idx;
      if (claim(idx)) {
        piece(idx);
        by_helper_.fetch_add(1, std::memory_order_relaxed);
        last = clock::now();
        continue;
      }
      if (std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - last).count() < spin_ns_) {
        for (int i = 0; i < 16 && !has_work(); ++i) _mm_pause();
        if (has_work()) continue;
        const auto before_yield = clock::now();
        sched_yield();  // a thread of the caller's process (OpenMP's) may want this core
        // A yield that took long ran another thread: the core is contended, and a spinning helper would be
        // descheduled in the middle of a piece the caller then waits for, where a woken sleeper is run at
        // once. So sleep until the next work instead.
        if (std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - before_yield).count() <
            kBusyYieldNs)
          continue;
      }
      std::unique_lock<std::mutex> lk(mu_);
      sleeping_.store(true, std::memory_order_seq_cst);
      cv_.wait(lk, [this] { return has_work(); });
      sleeping_.store(false, std::memory_order_seq_cst);
      last = clock::now();
    }
  }

  static constexpr int64_t kBusyYieldNs = 100000;  // an idle core returns from sched_yield in ~1-5 us
  std::atomic<uint64_t> ticket_{0};  // epoch << 32 | pieces << 16 | next unclaimed piece
  std::atomic<int> done_{0};
  std::atomic<bool> sleeping_{false};
  std::atomic<int64_t> by_helper_{0};
  uint64_t epoch_ = 0;
  const std::function<void(int)>* fn_ = nullptr;
  std::exception_ptr error_;
  std::mutex mu_, err_mu_;
  std::condition_variable cv_;
  int64_t spin_ns_ = 0;
  bool started_ = false;
  bool enabled_ = true;
};

// fn(begin, end) over [0, n) like at::parallel_for, but on the calling thread and the helper in up to
// `pieces` ranges claimed as they come, each thread with one OpenMP thread. Falls back to at::parallel_for
// when torch has one thread, inside a parallel region, or with the helper off. For kernels whose items write
// disjoint outputs (the result does not depend on which thread ran an item).
template <typename F>
void parallel_for(int64_t n, int64_t pieces, const F& fn) {
  if (n <= 0) return;
  Helper& h = Helper::get();
  const int threads = omp_get_max_threads();
  if (threads < 2 || omp_in_parallel() || !h.enabled() || n < 2) {
    at::parallel_for(0, n, 1, fn);
    return;
  }
  const int64_t p = std::min<int64_t>(std::max<int64_t>(pieces, 2), n);
  const std::function<void(int)> piece = [&](int i) { fn(n * i / p, n * (i + 1) / p); };
  omp_set_num_threads(1);
  try {
    h.run(static_cast<int>(p), piece);
  } catch (...) {
    omp_set_num_threads(threads);
    throw;
  }
  omp_set_num_threads(threads);
}

// A linear layer whose weight is cut by output columns into pieces, each packed for oneDNN
// (torch.ops.mkldnn._reorder_linear_weight): forward(x) runs the pieces' products on the calling thread
// and the helper, each with one thread, into one output. Each output column is one piece's product,
// computed as a single-threaded oneDNN call over the whole reduction, the same on either thread.
class SplitLinear {
 public:
  SplitLinear(std::vector<at::Tensor> packed, std::vector<c10::optional<at::Tensor>> bias,
              std::vector<int64_t> offsets)
      : packed_(std::move(packed)), bias_(std::move(bias)), offsets_(std::move(offsets)) {
    TORCH_CHECK(!packed_.empty() && bias_.size() == packed_.size() && offsets_.size() == packed_.size() + 1,
                "SplitLinear: one bias slot per piece and offsets for every piece plus the end");
  }

  at::Tensor forward(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() == 2, "SplitLinear: x must be 2-D");
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    at::Tensor out = at::empty({x.size(0), offsets_.back()}, x.options());
    const std::function<void(int)> fn = [&](int i) {
      torch::jit::Stack s;
      s.reserve(6);
      s.emplace_back(x);
      s.emplace_back(packed_[i]);
      s.emplace_back(bias_[i]);
      s.emplace_back(std::string("none"));
      s.emplace_back(c10::List<c10::optional<at::Scalar>>());
      s.emplace_back(c10::IValue());
      op.callBoxed(&s);
      out.narrow(1, offsets_[i], offsets_[i + 1] - offsets_[i]).copy_(s[0].toTensor());
    };
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    try {
      Helper::get().run(static_cast<int>(packed_.size()), fn);
    } catch (...) {
      omp_set_num_threads(threads);
      throw;
    }
    omp_set_num_threads(threads);
    return out;
  }

  int64_t pieces() const { return static_cast<int64_t>(packed_.size()); }

 private:
  std::vector<at::Tensor> packed_;
  std::vector<c10::optional<at::Tensor>> bias_;
  std::vector<int64_t> offsets_;
};

}  // namespace kvl_pool
