// Every tunable of tnt_comm: one TNT_* environment variable each, declared here and
// parsed in one place (config.cc). Defaults are chosen for correctness first.
#pragma once

#include <chrono>
#include <string>

namespace tnt {

// Seconds a collective may wait before it fails with StallError. Generous: a slow
// but healthy job (first step, checkpoint on rank 0) must not trip it.
inline constexpr const char* kTimeoutEnv = "TNT_COMM_TIMEOUT";
inline constexpr double kDefaultTimeoutSeconds = 600.0;

// Polling of an in-flight collective (see Note [Polling] in engine.cc): spin on
// MPI_Test this long, then sleep, doubling from kPollMinSleepUs up to this cap.
inline constexpr const char* kPollSpinEnv = "TNT_COMM_POLL_SPIN_US";
inline constexpr double kDefaultPollSpinUs = 200.0;
inline constexpr const char* kPollMaxSleepEnv = "TNT_COMM_POLL_MAX_SLEEP_US";
inline constexpr double kDefaultPollMaxSleepUs = 200.0;
inline constexpr double kPollMinSleepUs = 10.0;
// While a caller is blocked on a result, test without sleeping this long after the last
// progress (Note [Polling]); 0 = sleep between tests as during backprop.
inline constexpr const char* kWaitSpinEnv = "TNT_COMM_WAIT_SPIN_US";
inline constexpr double kDefaultWaitSpinUs = 0.0;
// How long either side of a hand-off spins before it blocks (Note [Hand-off]): a small
// collective's result usually arrives within it; past it a futex wake-up is cheaper
// than taking the core from the rank or thread being waited for. 0 = block at once.
// Unset: kAutoHandoffSpinUs where every rank on the host has a spare core, else 0.
inline constexpr const char* kHandoffSpinEnv = "TNT_COMM_HANDOFF_SPIN_US";
inline constexpr double kAutoHandoffSpinUs = 30.0;

// Note [Waiter drives] in engine.cc: a caller blocked on a result drives MPI itself for
// up to this long after the last progress, then hands back to the thread. 0 = never.
inline constexpr const char* kDriveSpinEnv = "TNT_COMM_DRIVE_SPIN_US";
inline constexpr double kDefaultDriveSpinUs = 200.0;
// Note [Transient buckets] in fused.cc: 1 = a fused engine lets go of its bucket buffers
// when a round's results are handed out (they live as long as their holders), so no
// gradient-sized set stays allocated between steps; 0 (default) = keep and reuse them.
inline constexpr const char* kTransientBucketsEnv = "TNT_COMM_TRANSIENT_BUCKETS";
// How often an idle communication thread wakes to answer stall queries of other ranks.
inline constexpr std::chrono::milliseconds kIdleServiceInterval{50};
// How long a stalled rank waits for the other ranks' answers before reporting.
inline constexpr std::chrono::milliseconds kStallQueryWait{2000};

struct Config {
  double timeout_s = kDefaultTimeoutSeconds;
  double poll_spin_us = kDefaultPollSpinUs;
  double poll_max_sleep_us = kDefaultPollMaxSleepUs;
  double wait_spin_us = kDefaultWaitSpinUs;
  double handoff_spin_us = -1.0;  // -1: unset, chosen by Engine::handoff_spin_us()
  double drive_spin_us = kDefaultDriveSpinUs;
  bool transient_buckets = true;  // Note [Transient buckets]; TNT_COMM_TRANSIENT_BUCKETS=0 keeps them
};

// Reads all TNT_COMM_* variables. Throws std::invalid_argument naming the variable,
// the bad value and an example of a good one.
Config load_config();

// The one parser of a number from the environment: `fallback` when unset or empty;
// must be > 0 (or >= 0 with allow_zero), else std::invalid_argument naming `name`.
double env_number(const char* name, double fallback, const char* example, bool allow_zero = false);

}  // namespace tnt
