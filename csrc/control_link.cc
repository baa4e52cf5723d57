// ControlLink's frames: sends queued and written, receives read and matched, on the round's
// thread (Note [Control link] in control_link.h). Connecting is in control_link_connect.cc.
#include "control_link.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "hypercube.h"

namespace hvdlite {
namespace {

constexpr size_t kFrameHeader = 16;  // u32 tag, u32 0, u64 length
constexpr size_t kReadChunk = 64 << 10;

std::string Describe(int rank) { return "rank " + std::to_string(rank); }

}  // namespace

ControlLink::~ControlLink() {
  if (listener_ >= 0) close(listener_);
  for (auto& [rank, p] : peers_) {
    if (p.fd >= 0) close(p.fd);
  }
}

std::vector<int> ControlLink::partners() const { return Hypercube(nullptr, rank_, size_).Peers(); }

void ControlLink::NotHere(const char* what) const {
  throw std::logic_error(std::string("the control link has no ") + what + ": point-to-point only");
}

ControlLink::Peer& ControlLink::PeerOf(int peer, const char* what) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) {
    throw std::logic_error("the control link of rank " + std::to_string(rank_) + " has no connection to rank " +
                           std::to_string(peer) + " (" + what + ")");
  }
  return it->second;
}

void ControlLink::Fail(Peer& p, const std::string& why, bool keep_reading) {
  if (p.failure.empty()) p.failure = why;
  p.out.clear();  // nothing more goes out on it
  p.out_at = 0;
  if (!keep_reading && p.fd >= 0) {
    close(p.fd);
    p.fd = -1;
    connections_.fetch_sub(1);
  }
}

void ControlLink::Flush(int rank, Peer& p) {
  while (p.fd >= 0 && p.out_at < p.out.size()) {
    const ssize_t n = send(p.fd, p.out.data() + p.out_at, p.out.size() - p.out_at, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p.out_at += static_cast<size_t>(n);
      p.written += static_cast<uint64_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      // What the peer sent before it went may still be unread (its kFailed first): read on
      // until the connection ends (Note [Control link], failures).
      Fail(p, Describe(rank) + "'s control connection failed (" + std::strerror(errno) + ")", true);
      return;
    }
  }
  if (p.out_at == p.out.size()) {
    p.out.clear();
    p.out_at = 0;
  }
}

void ControlLink::Read(int rank, Peer& p) {
  char chunk[kReadChunk];
  while (p.fd >= 0) {
    const ssize_t n = recv(p.fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      p.in.append(chunk, static_cast<size_t>(n));
      if (static_cast<size_t>(n) < sizeof(chunk)) break;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      Fail(p, Describe(rank) + " closed its control connection" +
                  (n == 0 ? std::string() : std::string(" (") + std::strerror(errno) + ")"));
      break;
    }
  }
  size_t at = 0;
  while (p.in.size() - at >= kFrameHeader) {
    uint32_t tag;
    uint64_t length;
    std::memcpy(&tag, p.in.data() + at, 4);
    std::memcpy(&length, p.in.data() + at + 8, 8);
    if (length > kMaxFrame) {
      Fail(p, Describe(rank) + " sent a malformed control frame (" + std::to_string(length) + " bytes)");
      p.in.clear();
      return;
    }
    if (p.in.size() - at - kFrameHeader < length) break;
    p.frames[tag].emplace_back(p.in.data() + at + kFrameHeader, length);
    frames_received_.fetch_add(1, std::memory_order_relaxed);
    at += kFrameHeader + length;
  }
  p.in.erase(0, at);
}

void ControlLink::Progress(int peer, const std::function<bool()>& done, const char* waiting_for) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  while (!done()) {
    Peer& waited = peers_.at(peer);
    // A failed peer whose connection is still open may have frames on the way: read to its end
    if (!waited.failure.empty() && waited.fd < 0) throw std::runtime_error(waited.failure);
    fds.clear();
    ranks.clear();
    for (auto& [rank, p] : peers_) {
      if (p.fd < 0) continue;
      fds.push_back({p.fd, static_cast<short>(POLLIN | (p.out_at < p.out.size() ? POLLOUT : 0)), 0});
      ranks.push_back(rank);
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      if (!waited.failure.empty()) throw std::runtime_error(waited.failure);
      std::ostringstream seconds;
      seconds << timeout_s_;
      throw std::runtime_error(Describe(peer) + " " + waiting_for + " on the control link within " + seconds.str() +
                               " s");
    }
    const int ready = poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno != EINTR) throw std::runtime_error(std::string("poll failed: ") + std::strerror(errno));
    for (size_t i = 0; ready > 0 && i < fds.size(); ++i) {
      Peer& p = peers_.at(ranks[i]);
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) Read(ranks[i], p);
      if (fds[i].revents & POLLOUT) Flush(ranks[i], p);
    }
  }
}

PendingWork ControlLink::StartSend(at::Tensor& bytes, int peer, int tag) {
  Peer& p = PeerOf(peer, "send");
  if (!p.failure.empty()) {
    // Thrown by the wait, not here: the caller may have a receive from that peer to wait on
    // first, whose frame (a kFailed with the first reason) arrived before the connection ended.
    const std::string failure = p.failure;
    return PendingWork([failure] { throw std::runtime_error(failure); }, [] { return true; });
  }
  const uint64_t length = static_cast<uint64_t>(bytes.numel());
  char header[kFrameHeader] = {};
  const uint32_t t = static_cast<uint32_t>(tag);
  std::memcpy(header, &t, 4);
  std::memcpy(header + 8, &length, 8);
  p.out.append(header, kFrameHeader);
  p.out.append(static_cast<const char*>(bytes.data_ptr()), length);
  p.queued += kFrameHeader + length;
  frames_sent_.fetch_add(1, std::memory_order_relaxed);
  Flush(peer, p);
  const uint64_t end = p.queued;
  // Written in full: the kernel has it. The tensor was copied, so the work holds nothing.
  auto written = [this, peer, end] { return peers_.at(peer).written >= end; };
  return PendingWork(
      [this, peer, written] {
        Progress(peer, [&] { return written() || !peers_.at(peer).failure.empty(); }, "did not read what was sent to it");
        if (!written()) throw std::runtime_error(peers_.at(peer).failure);
      },
      written);
}

PendingWork ControlLink::StartRecv(at::Tensor& bytes, int peer, int tag) {
  Peer& p = PeerOf(peer, "receive");
  const uint32_t t = static_cast<uint32_t>(tag);
  const uint64_t ticket = p.started[t]++;
  at::Tensor into = bytes;
  auto arrived = [this, peer, t] { return !peers_.at(peer).frames[t].empty(); };
  auto wait = [this, peer, t, ticket, into, arrived]() mutable {
    Peer& p = peers_.at(peer);
    if (p.taken[t] != ticket) throw std::logic_error("control link receives of one peer and tag waited out of order");
    Progress(peer, arrived, "sent no control message");
    std::string frame = std::move(p.frames[t].front());
    p.frames[t].pop_front();
    ++p.taken[t];
    if (static_cast<int64_t>(frame.size()) > into.numel()) {
      throw std::runtime_error(Describe(peer) + " sent a control transfer of " + std::to_string(frame.size()) +
                               " bytes where at most " + std::to_string(into.numel()) + " were expected");
    }
    std::memcpy(into.data_ptr(), frame.data(), frame.size());
  };
  return PendingWork(std::move(wait), arrived);
}

}  // namespace hvdlite
