#include "stall.h"

#include <sstream>

#include "config.h"

namespace tnt {
namespace {

std::string join(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

std::string stall_message(const std::string& what, double timeout_s, int rank,
                          std::uint64_t seq,
                          const std::vector<std::optional<std::uint64_t>>& progress) {
  std::vector<int> behind, ahead, silent, with_us;
  std::ostringstream detail;
  for (std::size_t r = 0; r < progress.size(); ++r) {
    if (static_cast<int>(r) == rank) continue;
    if (!progress[r]) {
      silent.push_back(static_cast<int>(r));
    } else if (*progress[r] < seq) {
      behind.push_back(static_cast<int>(r));
      detail << " rank " << r << " has started " << *progress[r] << ";";
    } else if (*progress[r] > seq) {
      ahead.push_back(static_cast<int>(r));
      detail << " rank " << r << " has started " << *progress[r] << ";";
    } else {
      with_us.push_back(static_cast<int>(r));
    }
  }
  std::ostringstream m;
  m << "tnt_comm: " << what << " did not complete within " << timeout_s << " s on rank "
    << rank << " (collective #" << seq << " of this rank).";
  if (!behind.empty() || !silent.empty() || !ahead.empty()) {
    if (!behind.empty()) m << " Missing ranks (never arrived): " << join(behind) << ".";
    if (!silent.empty()) m << " Ranks not answering (dead or stuck): " << join(silent) << ".";
    if (!ahead.empty()) m << " Ranks already past it: " << join(ahead) << ".";
    m << " Collectives started:" << detail.str();
  } else if (!with_us.empty()) {
    m << " All ranks reached this collective number; their collectives may differ in kind.";
  }
  m << " Likely causes: a rank skipped this collective or issued collectives in a different"
       " order, or a rank crashed or is blocked elsewhere. If the job is only slow, raise the"
       " limit with "
    << kTimeoutEnv << "=<seconds> (default " << kDefaultTimeoutSeconds << ").";
  return m.str();
}

}  // namespace tnt
