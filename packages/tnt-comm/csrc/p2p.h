// Point-to-point messages on a communicator (pipelining's activations and gradients).
// Each message travels as an envelope (the caller's header of small ints, dtype, shape)
// and a payload, both posted at once on their own tags, so messages between two ranks
// arrive in send order and the receiver checks the envelope against what it expects:
// a mismatch is an error naming both, on the receiving rank, and never a decode of
// foreign bytes. Like every operation, the communication thread issues them.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "buffer.h"
#include "collectives.h"
#include "engine.h"

namespace tnt {

inline constexpr int kMaxHeader = 8;

// A send or receive in flight, shared by the caller and the communication thread.
class Message {
 public:
  Message(Engine& engine, std::future<void> done, std::string what,
          std::shared_ptr<FusionBuffer> buffer)
      : engine_(engine), done_(std::move(done)), what_(std::move(what)), buffer_(std::move(buffer)) {}
  // Blocks until complete (call with the GIL released); rethrows its error every time.
  void wait();
  // True once complete (wait() then returns at once).
  bool test();
  // The received bytes (receives; valid after wait()).
  const std::shared_ptr<FusionBuffer>& buffer() const { return buffer_; }
  const std::string& describe() const { return what_; }

 private:
  Engine& engine_;
  std::mutex mu_;
  std::future<void> done_;
  bool finished_ = false;
  std::exception_ptr error_;
  std::string what_;
  std::shared_ptr<FusionBuffer> buffer_;
};

// How a send treats the caller's bytes.
enum class SendBuffer {
  kCopy,    // copied at once: the caller may reuse its array on return
  kBorrow,  // sent from the caller's memory: it must stay valid and unchanged until the
            // message completed (wait() returned) - saves a copy (4 MiB: ~1.5 ms) per send
};

std::shared_ptr<Message> isend(Engine& engine, const CommPtr& comm, const void* data,
                               const ArrayDesc& desc, int dest,
                               const std::vector<std::int64_t>& header,
                               SendBuffer buffer = SendBuffer::kCopy);
// Receives the next message from `source` into a new buffer of `expected`'s size;
// completes with MismatchError if its header, dtype or shape differ.
std::shared_ptr<Message> irecv(Engine& engine, const CommPtr& comm, int source,
                               const ArrayDesc& expected, const std::vector<std::int64_t>& header);

}  // namespace tnt
