// A fixed set of worker threads for the native GEMM (gemm_f32.cpp), which includes it.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace md {

// run(nt, f) calls f(0..nt-1), f(0) on the caller's thread,
// and returns when all are done. Between calls a worker polls for about kSpinNs (the GEMMs
// of one decode step follow each other within microseconds; a futex wake-up per call
// would cost more than a small GEMM), then sleeps on a condition variable, so an idle
// process leaves the cores to others.
constexpr int64_t kSpinNs = 200000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

class Pool {
  public:
    void run(int nt, const std::function<void(int)> &f) {
        if (nt <= 1) {
            f(0);
            return;
        }
        std::lock_guard<std::mutex> one_call(call_mu_);  // callers from several threads
        {
            std::lock_guard<std::mutex> lk(mu_);
            while (int(workers_.size()) < nt - 1) {
                int id = int(workers_.size()) + 1;
                workers_.emplace_back([this, id] { loop(id); });
                workers_.back().detach();
            }
            job_ = &f;
            active_ = nt;
            pending_.store(nt - 1, std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_release);
        }
        wake_.notify_all();
        f(0);
        const int64_t t0 = now_ns();
        while (pending_.load(std::memory_order_acquire) != 0) {
            if (now_ns() - t0 > kSpinNs) {
                std::unique_lock<std::mutex> lk(mu_);
                done_.wait(lk, [this] { return pending_.load() == 0; });
                break;
            }
            cpu_relax();
        }
    }

  private:
    void loop(int id) {
        uint64_t seen = 0;
        for (;;) {
            const int64_t t0 = now_ns();
            while (generation_.load(std::memory_order_acquire) == seen &&
                   now_ns() - t0 < kSpinNs)
                cpu_relax();
            const std::function<void(int)> *job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                wake_.wait(lk, [&] { return generation_.load() != seen; });
                seen = generation_.load();
                if (id >= active_) continue;
                job = job_;
            }
            (*job)(id);
            if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lk(mu_);   // the caller may be asleep
                done_.notify_one();
            }
        }
    }
    std::mutex call_mu_, mu_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    const std::function<void(int)> *job_ = nullptr;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    int active_ = 0;
};

inline Pool *g_pool = nullptr;   // leaked on purpose: never destroyed under a sleeping worker
inline std::atomic<int> g_threads{1};

inline void forget_pool_in_child() { g_pool = nullptr; }  // a forked child has no workers

inline Pool &pool() {
    static bool registered = (pthread_atfork(nullptr, nullptr, forget_pool_in_child), true);
    (void)registered;
    if (g_pool == nullptr) g_pool = new Pool();
    return *g_pool;
}

}  // namespace md
