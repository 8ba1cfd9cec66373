// Exceptions that reach Python: CommError -> tnt_comm.CommError (RuntimeError, .code),
// StallError -> tnt_comm.StallError, TypeError_ -> TypeError; std::invalid_argument
// becomes ValueError through pybind11's default translation.
#pragma once

#include <stdexcept>
#include <string>

namespace tnt {

class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what, int code = -1) : std::runtime_error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

class StallError : public CommError {
 public:
  using CommError::CommError;
};

// The ranks' collectives got out of step (a rank skipped one or ran an extra one): the
// engine becomes unusable, as after a stall. Reaches Python as tnt_comm.CommError.
class OutOfStepError : public CommError {
 public:
  using CommError::CommError;
};

// A point-to-point message arrived whole but differs from what the receiver expected
// (header, dtype or shape). Reported on the receiving rank; the engine stays usable.
class MismatchError : public CommError {
 public:
  using CommError::CommError;
};

class TypeError_ : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace tnt
