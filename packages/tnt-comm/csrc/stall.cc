#include "stall.h"

#include <sstream>

#include "config.h"

namespace tnt {
namespace {

// "1, 3" on the world; "1 (world rank 3)" on a derived communicator.
std::string join(const std::vector<int>& ranks, const Comm& comm) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(ranks[i]);
    const int w = comm.world_ranks.at(static_cast<std::size_t>(ranks[i]));
    if (w != ranks[i]) s += " (world rank " + std::to_string(w) + ")";
  }
  return s;
}

}  // namespace

std::string stall_message(const std::string& what, const Comm& comm, double timeout_s,
                          std::uint64_t seq, const std::vector<std::optional<Progress>>& progress) {
  const int rank = comm.rank;
  std::vector<int> behind, ahead, silent, with_us;
  std::ostringstream detail;
  for (std::size_t r = 0; r < progress.size(); ++r) {
    if (static_cast<int>(r) == rank) continue;
    if (!progress[r]) {
      silent.push_back(static_cast<int>(r));
    } else if (progress[r]->seq < seq) {
      behind.push_back(static_cast<int>(r));
      detail << " rank " << r << " has started " << progress[r]->seq << ";";
    } else if (progress[r]->seq > seq) {
      ahead.push_back(static_cast<int>(r));
      detail << " rank " << r << " has started " << progress[r]->seq << ";";
    } else {
      with_us.push_back(static_cast<int>(r));
    }
  }
  std::ostringstream m;
  m << "tnt_comm: " << what << " did not complete within " << timeout_s << " s on rank "
    << rank << (comm.id == 1 ? "" : " of " + comm.name) << " (collective #" << seq
    << " of this rank" << (comm.id == 1 ? "" : " on it") << ").";
  if (!behind.empty() || !silent.empty() || !ahead.empty()) {
    if (!behind.empty()) m << " Missing ranks (never arrived): " << join(behind, comm) << ".";
    if (!silent.empty()) m << " Ranks not answering (dead or stuck): " << join(silent, comm) << ".";
    if (!ahead.empty()) m << " Ranks already past it: " << join(ahead, comm) << ".";
    m << " Collectives started:" << detail.str();
  } else if (!with_us.empty()) {
    m << " All ranks reached this collective number; their collectives may differ in kind.";
  }
  m << " Likely causes: the ranks ran different collectives (a rank skipped this one or ran"
       " an extra one, e.g. inside `if rank == 0:`, or issued them in a different order), or a"
       " rank crashed or is blocked elsewhere. If the job is only slow, raise the limit with "
    << kTimeoutEnv << "=<seconds> (default " << kDefaultTimeoutSeconds << ").";
  return m.str();
}

}  // namespace tnt
