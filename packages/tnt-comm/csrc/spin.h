// Bounded spinning for the hand-offs between a blocked caller and the communication
// thread (Note [Hand-off] in engine.cc): a futex wake-up costs 10-60 us on a loaded VM,
// more than a small collective itself. Spin only where someone is blocked anyway.
#pragma once

#include <chrono>


namespace tnt {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls `ready` until it returns true (true) or `until` passes (false), a few pause
// instructions between polls. Never sched_yield(): under the EEVDF scheduler a yield
// moves the thread a whole time slice back behind CPU-bound neighbours (measured on 2
// loaded cores: a 4 B allreduce took ~1.7 ms with yielding spins, ~70 us without).
// So spins stay short (TNT_COMM_HANDOFF_SPIN_US) and then block on a futex, whose wake-up
// preempts a busy neighbour at once.
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::steady_clock::time_point until) {
  for (unsigned round = 1;; ++round) {
    if (ready()) return true;
    if ((round & 15u) == 0 && std::chrono::steady_clock::now() >= until) return false;
    for (int i = 0; i < 8; ++i) cpu_relax();
  }
}

}  // namespace tnt
