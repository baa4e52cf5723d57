// ControlLink's connections: the listener, the hello and its answer, and who connects to whom
// (Note [Control link] in control_link.h). Runs in init(), before the engine exists.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "control_link.h"

namespace hvdlite {
namespace {

constexpr size_t kHelloBytes = 16;   // u32 magic, u32 rank, u64 the listener's nonce
constexpr size_t kAnswerBytes = 8;   // u32 magic, u32 rank

std::runtime_error SystemError(const std::string& what) {
  return std::runtime_error("the control link could not " + what + ": " + std::strerror(errno));
}

int NonBlockingSocket() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw SystemError("make a socket");
  return fd;
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool ParseHost(const std::string& host, int port, sockaddr_in* out) {
  std::memset(out, 0, sizeof(*out));
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  return inet_pton(AF_INET, host.c_str(), &out->sin_addr) == 1;
}

// One way in to a partner below this rank, or one connection a stranger or a partner above
// this rank opened: bytes read so far, until its hello or answer is whole.
struct Pending {
  int fd = -1;
  int partner = -1;          // the partner it leads to (connecting), -1 while unknown (accepted)
  bool connected = false;    // connecting: the TCP connection is up and the hello sent
  std::string where;         // connecting: host:port, for messages
  std::string got;
};

uint32_t U32At(const std::string& s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

}  // namespace

ControlLink::ControlLink(int rank, int size, const std::string& listen_host, const std::vector<std::string>& published,
                         double timeout_s)
    : rank_(rank), size_(size), timeout_s_(timeout_s), published_(published) {
  std::random_device random;
  nonce_ = (static_cast<uint64_t>(random()) << 32) ^ random();
  sockaddr_in addr;
  if (!ParseHost(listen_host, 0, &addr)) {
    throw std::runtime_error("the control link cannot listen on '" + listen_host + "': not an IPv4 address");
  }
  listener_ = NonBlockingSocket();
  socklen_t len = sizeof(addr);
  if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(listener_, 128) != 0 ||
      getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const auto error = SystemError("listen on " + listen_host);
    close(listener_);
    listener_ = -1;
    throw error;
  }
  port_ = ntohs(addr.sin_port);
}

std::string ControlLink::address() const {
  std::ostringstream out;
  out << port_ << ':' << std::hex << nonce_ << std::dec << ':';
  for (size_t i = 0; i < published_.size(); ++i) out << (i ? "," : "") << published_[i];
  return out.str();
}

void ControlLink::Connect(const std::map<int, std::string>& addresses) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  std::set<int> below, above;
  for (int p : partners()) (p < rank_ ? below : above).insert(p);
  std::vector<Pending> pending;
  std::map<int, std::string> last_error;  // by partner
  auto adopt = [this](int partner, int fd) {
    NoDelay(fd);
    peers_[partner].fd = fd;
    connections_.fetch_add(1);
  };
  // A way in to every address of every partner below, all at once.
  for (int p : below) {
    auto it = addresses.find(p);
    std::string port, nonce, hosts;
    if (it != addresses.end()) {
      std::istringstream in(it->second);
      std::getline(in, port, ':');
      std::getline(in, nonce, ':');
      std::getline(in, hosts);
    }
    std::istringstream list(hosts);
    for (std::string host; std::getline(list, host, ',');) {
      sockaddr_in addr;
      if (!ParseHost(host, std::atoi(port.c_str()), &addr)) continue;
      Pending way{NonBlockingSocket(), p, false, host + ":" + port, std::string()};
      if (connect(way.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
        last_error[p] = way.where + ": " + std::strerror(errno);
        close(way.fd);
        continue;
      }
      // the hello goes out once the connection is up; it carries the partner's nonce
      way.got = std::string(reinterpret_cast<const char*>(&kMagic), 4);
      const uint32_t me = static_cast<uint32_t>(rank_);
      const uint64_t theirs = std::strtoull(nonce.c_str(), nullptr, 16);
      way.got.append(reinterpret_cast<const char*>(&me), 4);
      way.got.append(reinterpret_cast<const char*>(&theirs), 8);
      pending.push_back(std::move(way));
    }
    if (it == addresses.end()) last_error[p] = "no address published";
  }
  auto close_way = [&](size_t i) {
    close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  auto missing = [&] {
    std::vector<int> left;
    for (int p : below) if (!peers_.count(p)) left.push_back(p);
    for (int p : above) if (!peers_.count(p)) left.push_back(p);
    return left;
  };
  std::vector<pollfd> fds;
  while (!missing().empty()) {
    const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left_ms <= 0) break;
    fds.clear();
    fds.push_back({listener_, POLLIN, 0});
    for (const Pending& way : pending) {
      fds.push_back({way.fd, static_cast<short>(way.partner >= 0 && !way.connected ? POLLOUT : POLLIN), 0});
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left_ms, 1000))) < 0 && errno != EINTR) {
      throw SystemError("wait for its partners");
    }
    for (size_t i = pending.size(); i-- > 0;) {
      const short revents = fds[i + 1].revents;
      if (revents == 0) continue;
      Pending& way = pending[i];
      if (way.partner >= 0 && peers_.count(way.partner)) {  // another address of it answered first
        close_way(i);
        continue;
      }
      if (way.partner >= 0 && !way.connected) {
        int error = 0;
        socklen_t len = sizeof(error);
        getsockopt(way.fd, SOL_SOCKET, SO_ERROR, &error, &len);
        const std::string hello = way.got;
        if (error != 0 || send(way.fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
          last_error[way.partner] = way.where + ": " + std::strerror(error != 0 ? error : errno);
          close_way(i);
          continue;
        }
        way.connected = true;
        way.got.clear();
        continue;
      }
      const size_t want = way.partner >= 0 ? kAnswerBytes : kHelloBytes;
      char buffer[kHelloBytes];
      const ssize_t n = recv(way.fd, buffer, want - way.got.size(), MSG_DONTWAIT);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (way.partner >= 0) last_error[way.partner] = way.where + ": closed before answering";
        close_way(i);
        continue;
      }
      way.got.append(buffer, static_cast<size_t>(n));
      if (way.got.size() < want) continue;
      const uint32_t magic = U32At(way.got, 0), who = U32At(way.got, 4);
      if (way.partner >= 0) {  // the answer of a partner below
        if (magic != kMagic || static_cast<int>(who) != way.partner) {
          last_error[way.partner] = way.where + ": answered by something other than rank " + std::to_string(way.partner);
          close_way(i);
          continue;
        }
        adopt(way.partner, way.fd);
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      uint64_t nonce;
      std::memcpy(&nonce, way.got.data() + 8, 8);
      const int from = static_cast<int>(who);
      if (magic != kMagic || nonce != nonce_ || !above.count(from) || peers_.count(from)) {
        close_way(i);  // a stranger, or a hello this rank did not ask for
        continue;
      }
      char answer[kAnswerBytes];
      const uint32_t me = static_cast<uint32_t>(rank_);
      std::memcpy(answer, &kMagic, 4);
      std::memcpy(answer + 4, &me, 4);
      if (send(way.fd, answer, sizeof(answer), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(answer))) {
        close_way(i);
        continue;
      }
      adopt(from, way.fd);
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
    // New connections, after the pass above (whose indices they would shift). Past
    // kMaxUnverified the oldest unverified one goes: a stranger cannot make this rank hold
    // more, and a flood cannot keep a partner out (its hello follows its connection at once).
    if (fds[0].revents & POLLIN) {
      for (int fd; (fd = accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;) {
        const auto unverified = std::count_if(pending.begin(), pending.end(), [](const Pending& w) { return w.partner < 0; });
        if (unverified >= kMaxUnverified) {
          close_way(static_cast<size_t>(std::find_if(pending.begin(), pending.end(), [](const Pending& w) { return w.partner < 0; }) -
                                        pending.begin()));
        }
        pending.push_back(Pending{fd, -1, false, std::string(), std::string()});
      }
    }
  }
  for (Pending& way : pending) close(way.fd);
  close(listener_);
  listener_ = -1;
  const std::vector<int> left = missing();
  if (left.empty()) return;
  std::string why = "rank " + std::to_string(rank_) + " could not connect its control link to ";
  for (size_t i = 0; i < left.size(); ++i) {
    why += (i ? ", rank " : "rank ") + std::to_string(left[i]);
    auto error = last_error.find(left[i]);
    why += error != last_error.end() ? " (" + error->second + ")"
                                     : (left[i] > rank_ ? " (it never connected)" : " (no answer)");
  }
  throw std::runtime_error(why + " within " + std::to_string(static_cast<int64_t>(timeout_s_)) + " s");
}

}  // namespace hvdlite
