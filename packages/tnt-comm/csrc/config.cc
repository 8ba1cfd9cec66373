#include "config.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace tnt {

double env_number(const char* name, double fallback, const char* example, bool allow_zero) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return fallback;
  const std::string text(raw);
  std::size_t used = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  while (used < text.size() && std::isspace(static_cast<unsigned char>(text[used]))) ++used;
  if (used == 0 || used != text.size() || !std::isfinite(value) || value < 0.0 ||
      (value == 0.0 && !allow_zero)) {
    throw std::invalid_argument(std::string(name) + "='" + text +
                                (allow_zero ? "' is not a number >= 0" : "' is not a number > 0") +
                                "; set it like " + name + "=" +
                                example + " or unset it for the default");
  }
  return value;
}

Config load_config() {
  Config c;
  c.timeout_s = env_number(kTimeoutEnv, kDefaultTimeoutSeconds, "600");
  c.poll_spin_us = env_number(kPollSpinEnv, kDefaultPollSpinUs, "200", true);
  c.poll_max_sleep_us = env_number(kPollMaxSleepEnv, kDefaultPollMaxSleepUs, "200");
  c.wait_spin_us = env_number(kWaitSpinEnv, kDefaultWaitSpinUs, "1000", true);
  c.handoff_spin_us = env_number(kHandoffSpinEnv, -1.0, "30", true);
  c.drive_spin_us = env_number(kDriveSpinEnv, kDefaultDriveSpinUs, "200", true);
  c.transient_buckets = env_number(kTransientBucketsEnv, 1.0, "0", true) != 0.0;
  return c;
}

}  // namespace tnt
