// Bounded spinning for the hand-offs between a blocked caller and the communication
// thread (Note [Hand-off] in engine.cc): a futex wake-up costs 10-60 us on a loaded VM,
// more than a small collective itself. Spin only where someone is blocked anyway.
#pragma once

#include <chrono>

#include <sched.h>

namespace tnt {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polls `ready` until it returns true (true) or `until` passes (false). Between polls a
// few pause instructions and a sched_yield(): on a host with more runnable threads than
// cores the spinner gives its core to whoever it waits for. (Measured on 2 ranks on 2
// loaded cores: without the yield a 4 KiB round took ~450 us, with it ~30 us.)
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::steady_clock::time_point until) {
  for (unsigned round = 1;; ++round) {
    if (ready()) return true;
    if ((round & 3u) == 0 && std::chrono::steady_clock::now() >= until) return false;
    for (int i = 0; i < 8; ++i) cpu_relax();
    ::sched_yield();
  }
}

}  // namespace tnt
