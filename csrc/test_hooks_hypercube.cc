// Test hooks: the control plane's hypercube (hypercube.h) run by N virtual ranks in one
// process, one thread each, over in-memory mailboxes or over real control links on 127.0.0.1
// (control_link.h). tests/unit checks its results, its failure reports and its counts; bench/
// uses the counts to model large jobs. Nothing here is used by a running job.
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "backend.h"
#include "cached_round.h"
#include "control_link.h"
#include "hypercube.h"
#include "test_hooks.h"

namespace py = pybind11;

namespace hvdlite {
namespace {

// Messages in flight between virtual ranks, by (from, to, tag), in the order sent.
struct Mailboxes {
  std::mutex mu;
  std::condition_variable arrived;
  std::map<std::tuple<int, int, int>, std::deque<std::string>> queues;
  std::set<int> dead;  // a dead rank's peers see their transfers with it fail at once
  std::chrono::milliseconds timeout;
};

// One virtual rank's end: what a Gloo group's point-to-point does, in memory.
class MailboxLink final : public CollectiveBackend {
 public:
  MailboxLink(Mailboxes* boxes, int rank) : boxes_(boxes), rank_(rank) {}

  PendingWork StartSend(at::Tensor& bytes, int peer, int tag) override {
    std::lock_guard<std::mutex> lock(boxes_->mu);
    if (boxes_->dead.count(peer)) throw std::runtime_error("Connection closed by peer");
    boxes_->queues[{rank_, peer, tag}].emplace_back(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
    ++sent;
    sent_bytes += bytes.numel();
    peers.insert(peer);
    boxes_->arrived.notify_all();
    return PendingWork([] {}, [] { return true; });
  }

  PendingWork StartRecv(at::Tensor& bytes, int peer, int tag) override {
    peers.insert(peer);
    Mailboxes* boxes = boxes_;
    const int me = rank_;
    return PendingWork([boxes, me, peer, tag, bytes, this] {
      std::unique_lock<std::mutex> lock(boxes->mu);
      auto& queue = boxes->queues[{peer, me, tag}];
      const bool came = boxes->arrived.wait_for(lock, boxes->timeout, [&] {
        return !queue.empty() || boxes->dead.count(peer);
      });
      if (queue.empty()) throw std::runtime_error(came ? "Connection closed by peer" : "Timed out");
      std::string message = std::move(queue.front());
      queue.pop_front();
      if (static_cast<int64_t>(message.size()) > bytes.numel()) throw std::runtime_error("message too long");
      std::memcpy(bytes.data_ptr(), message.data(), message.size());
      received_bytes += static_cast<int64_t>(message.size());
    });
  }

  PendingWork StartAllreduce(at::Tensor&, ReduceOp) override { throw std::logic_error("unused"); }
  void Broadcast(at::Tensor&, int) override { throw std::logic_error("unused"); }
  void Allgather(at::Tensor&, std::vector<at::Tensor>&) override { throw std::logic_error("unused"); }
  void Alltoall(at::Tensor&, at::Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    throw std::logic_error("unused");
  }
  std::string name() const override { return "mailbox"; }

  int64_t sent = 0, sent_bytes = 0, received_bytes = 0;
  std::set<int> peers;

 private:
  Mailboxes* boxes_;
  int rank_;
};

// Every virtual rank but the dead ones runs `rounds` rounds of the hypercube; returns, by
// rank, (messages of the last round, or None; the error, or None; transfers sent; bytes sent;
// bytes received; the peers it exchanged with; the hypercube's own peer list).
// With `reduce`, each rank runs Reduce with CombineOffers instead (Note [Cached rounds]), and
// its result is a one-element list: the combination.
py::list RunHypercube(const std::vector<std::string>& mine, int64_t slot, const std::vector<int>& dead, int rounds,
                      double timeout_seconds, bool reduce) {
  const int size = static_cast<int>(mine.size());
  Mailboxes boxes;
  boxes.dead.insert(dead.begin(), dead.end());
  boxes.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  std::vector<std::unique_ptr<MailboxLink>> links;
  std::vector<std::unique_ptr<Hypercube>> cubes;
  for (int r = 0; r < size; ++r) {
    links.push_back(std::make_unique<MailboxLink>(&boxes, r));
    cubes.push_back(std::make_unique<Hypercube>(links.back().get(), r, size));
  }
  std::vector<std::vector<std::string>> results(size);
  std::vector<std::string> errors(size);
  std::vector<char> failed(size, 0);  // not vector<bool>: one thread per rank writes its own
  {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      if (boxes.dead.count(r)) continue;
      threads.emplace_back([&, r] {
        try {
          for (int k = 0; k < rounds; ++k) {
            results[r] = reduce ? std::vector<std::string>{cubes[r]->Reduce(mine[r], CombineOffers)}
                                : cubes[r]->Allgather(mine[r], slot);
          }
        } catch (const std::exception& e) {
          errors[r] = e.what();
          failed[r] = true;
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
  py::list out;
  for (int r = 0; r < size; ++r) {
    py::object messages = py::none(), error = py::none();
    if (failed[r]) {
      error = py::str(errors[r]);
    } else if (!boxes.dead.count(r)) {
      py::list list;
      for (const std::string& m : results[r]) list.append(py::bytes(m));
      messages = list;
    }
    const MailboxLink& link = *links[r];
    out.append(py::make_tuple(messages, error, link.sent, link.sent_bytes, link.received_bytes,
                              std::vector<int>(link.peers.begin(), link.peers.end()), cubes[r]->Peers()));
  }
  return out;
}

// Note [Control link]: `messages.size()` virtual ranks, each with a real ControlLink on
// 127.0.0.1, connected all at once (one thread each, as init() connects in every process);
// each link of `dead` is then closed (a rank that died after init), and every other rank runs
// `rounds` rounds of Allgather, or of Reduce by CombineOffers. Returns, by rank, (messages of
// the last round or None, the error or None, frames sent, frames received, connections).
py::list RunLinkHypercube(const std::vector<std::string>& mine, int64_t slot, const std::vector<int>& dead,
                          int rounds, double timeout_seconds, bool reduce) {
  const int size = static_cast<int>(mine.size());
  std::vector<std::unique_ptr<ControlLink>> links;
  std::map<int, std::string> addresses;
  for (int r = 0; r < size; ++r) {
    links.push_back(std::make_unique<ControlLink>(r, size, "127.0.0.1", std::vector<std::string>{"127.0.0.1"},
                                                  timeout_seconds));
    addresses[r] = links.back()->address();
  }
  std::vector<std::vector<std::string>> results(size);
  std::vector<std::string> errors(size);
  std::vector<char> failed(size, 0);  // not vector<bool>: one thread per rank writes its own
  const std::set<int> gone(dead.begin(), dead.end());
  {
    py::gil_scoped_release release;
    auto each = [&](const std::function<void(int)>& body) {
      std::vector<std::thread> threads;
      for (int r = 0; r < size; ++r) {
        threads.emplace_back([&, r] {
          try {
            body(r);
          } catch (const std::exception& e) {
            errors[r] = e.what();
            failed[r] = true;
          }
        });
      }
      for (std::thread& t : threads) t.join();
    };
    each([&](int r) { links[r]->Connect(addresses); });
    for (int r : gone) links[r].reset();
    each([&](int r) {
      if (gone.count(r) || failed[r]) return;
      Hypercube cube(links[r].get(), r, size);
      for (int k = 0; k < rounds; ++k) {
        results[r] = reduce ? std::vector<std::string>{cube.Reduce(mine[r], CombineOffers)} : cube.Allgather(mine[r], slot);
      }
    });
  }
  py::list out;
  for (int r = 0; r < size; ++r) {
    py::object messages = py::none(), error = failed[r] ? py::object(py::str(errors[r])) : py::object(py::none());
    if (!failed[r] && !gone.count(r)) {
      py::list list;
      for (const std::string& m : results[r]) list.append(py::bytes(m));
      messages = list;
    }
    const bool here = links[r] != nullptr;
    out.append(py::make_tuple(messages, error, here ? links[r]->frames_sent() : 0, here ? links[r]->frames_received() : 0,
                              here ? links[r]->connections() : 0));
  }
  return out;
}

py::bytes CachedOfferBytes(int rank, bool clean, bool outstanding, uint64_t settings, uint64_t state, int64_t clock_ms,
                           int64_t base_us, uint32_t id_space, const std::vector<uint32_t>& ids,
                           const std::map<uint32_t, std::string>& payloads) {
  CachedOffer offer;
  offer.rank = rank;
  offer.clean = clean;
  offer.outstanding = outstanding;
  offer.settings_digest = settings;
  offer.state_digest = state;
  offer.clock_ms = clock_ms;
  offer.base_us = base_us;
  offer.id_space = id_space;
  offer.ids = ids;
  offer.idle = ids.empty();
  offer.payloads = payloads;
  return py::bytes(EncodeOffer(offer));
}

py::dict CachedVerdictDict(const std::string& combined, int size) {
  CachedVerdict v;
  Status status = ReadVerdict(combined, size, &v);
  if (!status.ok()) throw std::runtime_error(status.message());
  py::dict out;
  out["all_clean"] = v.all_clean;
  out["agree"] = v.agree;
  out["all_outstanding"] = v.all_outstanding;
  out["all_idle"] = v.all_idle;
  out["clock_ms"] = v.clock_ms;
  out["base_us"] = v.base_us;
  out["ready"] = v.ready;
  py::list payloads;
  for (const auto& by_id : v.payloads) {
    py::dict d;
    for (const auto& [id, bytes] : by_id) d[py::int_(id)] = py::bytes(bytes);
    payloads.append(d);
  }
  out["payloads"] = payloads;
  return out;
}

}  // namespace

void DefineHypercubeHooks(py::module_& m) {
  m.def("_hypercube", &RunHypercube, py::arg("messages"), py::arg("slot"), py::arg("dead") = std::vector<int>(),
        py::arg("rounds") = 1, py::arg("timeout_seconds") = 10.0, py::arg("reduce") = false);
  m.def("_link_hypercube", &RunLinkHypercube, py::arg("messages"), py::arg("slot"), py::arg("dead") = std::vector<int>(),
        py::arg("rounds") = 1, py::arg("timeout_seconds") = 10.0, py::arg("reduce") = false);
  // Note [Cached rounds]: one rank's offer, the combination of two, and what a combination says.
  m.def("_cached_offer", &CachedOfferBytes, py::arg("rank"), py::arg("clean"), py::arg("outstanding"),
        py::arg("settings"), py::arg("state"), py::arg("clock_ms"), py::arg("base_us"), py::arg("id_space"),
        py::arg("ids"), py::arg("payloads"));
  m.def("_cached_combine", [](const std::string& a, const std::string& b) { return py::bytes(CombineOffers(a, b)); });
  m.def("_cached_verdict", &CachedVerdictDict, py::arg("combined"), py::arg("size"));
}

}  // namespace hvdlite
