#include "p2p.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "errors.h"
#include "task.h"

namespace tnt {
namespace {

// Tags on the communicator's data plane (collectives never match point-to-point).
constexpr int kEnvelopeTag = 1001;
constexpr int kPayloadTag = 1002;

struct Envelope {
  Meta meta;
  std::int32_t nheader;
  std::int32_t reserved;
  std::int64_t header[kMaxHeader];
};

std::string header_str(const std::int64_t* h, std::size_t n) {
  std::ostringstream s;
  s << "(";
  for (std::size_t i = 0; i < n; ++i) s << (i ? ", " : "") << h[i];
  s << (n == 1 ? ",)" : ")");
  return s.str();
}

std::string header_str(const std::vector<std::int64_t>& h) { return header_str(h.data(), h.size()); }

Envelope make_envelope(const ArrayDesc& desc, const std::vector<std::int64_t>& header) {
  if (header.size() > static_cast<std::size_t>(kMaxHeader)) {
    throw std::invalid_argument("header " + header_str(header) + " has " +
                                std::to_string(header.size()) + " entries; at most " +
                                std::to_string(kMaxHeader) + " are supported");
  }
  Envelope e{};
  e.meta = to_meta(desc, -1);
  e.nheader = static_cast<std::int32_t>(header.size());
  for (std::size_t i = 0; i < header.size(); ++i) e.header[i] = header[i];
  return e;
}

void check_peer(const Comm& comm, int peer, const char* what) {
  if (peer < 0 || peer >= comm.size) {
    throw std::invalid_argument(std::string(what) + "=" + std::to_string(peer) + " is not a rank of " +
                                comm.name + " (ranks are 0.." + std::to_string(comm.size - 1) + ")");
  }
}

}  // namespace

void Message::wait() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!finished_) {
    try {
      engine_.await(done_, what_);
    } catch (...) {
      error_ = std::current_exception();
    }
    finished_ = true;
  }
  if (error_) std::rethrow_exception(error_);
}

bool Message::test() {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_ || done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

std::shared_ptr<Message> isend(Engine& engine, const CommPtr& comm, const void* data,
                               const ArrayDesc& desc, int dest,
                               const std::vector<std::int64_t>& header, SendBuffer buffer) {
  check_peer(*comm, dest, "send: dest");
  auto envelope = std::make_shared<Envelope>(make_envelope(desc, header));
  const std::int64_t nbytes = desc.nbytes();
  std::shared_ptr<FusionBuffer> copy;  // kBorrow: none, the caller keeps `data` alive
  if (buffer == SendBuffer::kCopy) {
    copy = std::make_shared<FusionBuffer>(static_cast<std::size_t>(nbytes), FusionBuffer::Fill::kNone);
    if (nbytes > 0) std::memcpy(copy->data(), data, static_cast<std::size_t>(nbytes));
    data = copy->data();
  }
  std::vector<StepTask::Step> steps;
  steps.push_back([envelope, copy, data, nbytes, dest](DataPlane& t) -> std::unique_ptr<Request> {
    return std::make_unique<BothRequest>(
        t.isend(envelope.get(), sizeof(Envelope), dest, kEnvelopeTag),
        t.isend(data, nbytes, dest, kPayloadTag));
  });
  const std::string what = "send(to rank " + std::to_string(dest) + ", header " + header_str(header) +
                           ", " + desc.str() + ") on " + comm->name;
  auto task = std::make_shared<StepTask>(comm, what, std::move(steps));
  task->set_peer(dest);
  auto msg = std::make_shared<Message>(engine, task->future(), what, nullptr);
  engine.enqueue(std::move(task));
  return msg;
}

std::shared_ptr<Message> irecv(Engine& engine, const CommPtr& comm, int source,
                               const ArrayDesc& expected, const std::vector<std::int64_t>& header) {
  check_peer(*comm, source, "recv: source");
  const Envelope want = make_envelope(expected, header);
  struct Inbox {
    Envelope got{};
    std::int64_t envelope_bytes = 0, payload_bytes = 0;
  };
  auto in = std::make_shared<Inbox>();
  const std::int64_t nbytes = expected.nbytes();
  auto payload = std::make_shared<FusionBuffer>(static_cast<std::size_t>(nbytes), FusionBuffer::Fill::kNone);
  const std::string what = "recv(from rank " + std::to_string(source) + ", header " +
                           header_str(header) + ", " + expected.str() + ") on " + comm->name;
  std::vector<StepTask::Step> steps;
  steps.push_back([in, payload, nbytes, source](DataPlane& t) -> std::unique_ptr<Request> {
    return std::make_unique<BothRequest>(
        t.irecv(&in->got, sizeof(Envelope), source, kEnvelopeTag, &in->envelope_bytes),
        t.irecv(payload->data(), nbytes, source, kPayloadTag, &in->payload_bytes));
  });
  steps.push_back([in, want, nbytes, source, what](DataPlane&) -> std::unique_ptr<Request> {
    const Envelope& got = in->got;
    std::ostringstream m;
    m << "tnt_comm: " << what << ": ";
    if (in->envelope_bytes != static_cast<std::int64_t>(sizeof(Envelope)) || !meta_valid(got.meta) ||
        got.nheader < 0 || got.nheader > kMaxHeader) {
      m << "rank " << source << " sent a message that is no tnt_comm message (different "
        << "tnt_comm versions, or another library using this communicator)";
      throw MismatchError(m.str());
    }
    const bool same_header = got.nheader == want.nheader &&
                             std::equal(got.header, got.header + got.nheader, want.header);
    const bool same_array = std::memcmp(&got.meta, &want.meta, sizeof(Meta)) == 0;
    if (!same_header || !same_array) {
      m << "expected header "
        << header_str(want.header, static_cast<std::size_t>(want.nheader)) << " with "
        << from_meta(want.meta).str() << ", but the next message from rank " << source
        << " has header " << header_str(got.header, static_cast<std::size_t>(got.nheader)) << " with "
        << from_meta(got.meta).str() << " (" << (same_header ? "" : "header")
        << (!same_header && !same_array ? " and " : "") << (same_array ? "" : "dtype/shape")
        << " differ). Messages between two ranks arrive in send order: the ranks' schedules "
           "differ (a skipped or extra send, or another order), or the receiver expects the "
           "wrong dtype or shape. The message was consumed.";
      throw MismatchError(m.str());
    }
    if (in->payload_bytes != nbytes) {
      m << "the payload has " << in->payload_bytes << " bytes, expected " << nbytes;
      throw MismatchError(m.str());
    }
    return nullptr;
  });
  auto task = std::make_shared<StepTask>(comm, what, std::move(steps));
  task->set_peer(source);
  auto msg = std::make_shared<Message>(engine, task->future(), what, payload);
  engine.enqueue(std::move(task));
  return msg;
}

}  // namespace tnt
