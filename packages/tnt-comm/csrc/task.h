// A unit of work for the communication thread: one logical collective, made of one or
// more non-blocking steps (e.g. a metadata exchange, then the data). Tasks run strictly
// in enqueue order, one at a time, so every rank issues its collectives in one order.
#pragma once

#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport.h"

namespace tnt {

class Task {
 public:
  virtual ~Task() = default;
  // Names the operation in error messages, e.g. "allreduce(float32[1000], SUM)".
  virtual std::string describe() const = 0;
  // Issues the next non-blocking step; nullptr once the task is complete. May throw.
  virtual std::unique_ptr<Request> next(Transport& transport) = 0;
  // Called exactly once on the communication thread: nullptr on success.
  virtual void finish(std::exception_ptr error) noexcept = 0;
};

// A task given as a list of steps, completed through a future. A step returns the
// request it started, or nullptr if it did only local work.
class StepTask final : public Task {
 public:
  using Step = std::function<std::unique_ptr<Request>(Transport&)>;

  StepTask(std::string what, std::vector<Step> steps)
      : what_(std::move(what)), steps_(std::move(steps)) {}

  std::future<void> future() { return done_.get_future(); }
  std::string describe() const override { return what_; }

  std::unique_ptr<Request> next(Transport& transport) override {
    while (next_step_ < steps_.size()) {
      if (auto r = steps_[next_step_++](transport)) return r;
    }
    return nullptr;
  }

  void finish(std::exception_ptr error) noexcept override {
    if (error) {
      done_.set_exception(error);
    } else {
      done_.set_value();
    }
  }

 private:
  std::string what_;
  std::vector<Step> steps_;
  std::size_t next_step_ = 0;
  std::promise<void> done_;
};

}  // namespace tnt
