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

// One address of a partner below this rank, to connect to (again, if a connection to it closed
// before the answer: a flood of strangers at the partner's listener may have pushed it out).
struct Dial {
  int partner = -1;
  sockaddr_in addr{};
  std::string where;  // host:port, for messages
  std::string hello;  // [magic, this rank, the partner's nonce]
  bool dead = false;  // refused or answered wrongly: no listener of that partner there
  std::chrono::steady_clock::time_point again{};  // when to dial once more (a closed attempt)
  bool waiting = false;                           // an attempt is open
};

// One way in: a connection this rank opened to a dial (partner >= 0), or one that a stranger or
// a partner above this rank opened (partner -1 until its hello is read); the bytes read so far.
struct Pending {
  int fd = -1;
  int partner = -1;
  size_t dial = 0;          // connecting: which dial
  bool connected = false;   // connecting: the TCP connection is up and the hello sent
  std::string got;
};

// Closes every fd it still holds when init() gives up, whichever way it leaves.
struct PendingSet {
  std::vector<Pending> ways;
  ~PendingSet() {
    for (Pending& way : ways) close(way.fd);
  }
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
  std::map<int, std::string> last_error;  // by partner
  std::vector<Dial> dials;
  for (int p : below) {
    auto it = addresses.find(p);
    if (it == addresses.end()) {
      last_error[p] = "no address published";
      continue;
    }
    std::string port, nonce, hosts;
    std::istringstream in(it->second);
    std::getline(in, port, ':');
    std::getline(in, nonce, ':');
    std::getline(in, hosts);
    const uint32_t me = static_cast<uint32_t>(rank_);
    const uint64_t theirs = std::strtoull(nonce.c_str(), nullptr, 16);
    std::string hello(reinterpret_cast<const char*>(&kMagic), 4);
    hello.append(reinterpret_cast<const char*>(&me), 4);
    hello.append(reinterpret_cast<const char*>(&theirs), 8);
    std::istringstream list(hosts);
    for (std::string host; std::getline(list, host, ',');) {
      Dial dial;
      dial.partner = p;
      dial.where = host + ":" + port;
      dial.hello = hello;
      if (ParseHost(host, std::atoi(port.c_str()), &dial.addr)) dials.push_back(dial);
    }
    if (std::none_of(dials.begin(), dials.end(), [p](const Dial& d) { return d.partner == p; })) {
      last_error[p] = "no usable address in '" + it->second + "'";
    }
  }
  PendingSet pending;
  auto& ways = pending.ways;
  auto close_way = [&](size_t i) {
    Pending& way = ways[i];
    if (way.partner >= 0) dials[way.dial].waiting = false;
    close(way.fd);
    ways.erase(ways.begin() + static_cast<std::ptrdiff_t>(i));
  };
  auto adopt = [this](int partner, int fd) {
    NoDelay(fd);
    peers_[partner].fd = fd;
    connections_.fetch_add(1);
  };
  auto lost = [&](Pending& way, const std::string& why, bool dead) {  // a way to a dial ended
    Dial& dial = dials[way.dial];
    last_error[dial.partner] = dial.where + ": " + why;
    dial.dead = dead;
    dial.again = Clock::now() + std::chrono::milliseconds(50);
  };
  auto missing = [&] {
    std::vector<int> left;
    for (int p : below) if (!peers_.count(p)) left.push_back(p);
    for (int p : above) if (!peers_.count(p)) left.push_back(p);
    return left;
  };
  // A partner below that no address can reach any more (each refused or answered wrongly: its
  // listener was open before its address was published) is lost now, not at the deadline.
  auto unreachable = [&] {
    for (int p : below) {
      if (peers_.count(p)) continue;
      if (std::all_of(dials.begin(), dials.end(), [p](const Dial& d) { return d.partner != p || d.dead; })) return true;
    }
    return false;
  };
  std::vector<pollfd> fds;
  while (!missing().empty() && !unreachable()) {
    const auto now = Clock::now();
    const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    if (left_ms <= 0) break;
    for (size_t d = 0; d < dials.size(); ++d) {  // dial every address not dialled yet (or again)
      Dial& dial = dials[d];
      if (dial.dead || dial.waiting || peers_.count(dial.partner) || now < dial.again) continue;
      Pending way{NonBlockingSocket(), dial.partner, d, false, std::string()};
      if (connect(way.fd, reinterpret_cast<sockaddr*>(&dial.addr), sizeof(dial.addr)) != 0 && errno != EINPROGRESS) {
        last_error[dial.partner] = dial.where + ": " + std::strerror(errno);
        dial.dead = true;
        close(way.fd);
        continue;
      }
      dial.waiting = true;
      ways.push_back(std::move(way));
    }
    fds.clear();
    fds.push_back({listener_, POLLIN, 0});
    for (const Pending& way : ways) {
      fds.push_back({way.fd, static_cast<short>(way.partner >= 0 && !way.connected ? POLLOUT : POLLIN), 0});
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left_ms, 50))) < 0 && errno != EINTR) {
      throw SystemError("wait for its partners");
    }
    for (size_t i = ways.size(); i-- > 0;) {
      const short revents = fds[i + 1].revents;
      if (revents == 0) continue;
      Pending& way = ways[i];
      if (way.partner >= 0 && peers_.count(way.partner)) {  // another address of it answered first
        close_way(i);
        continue;
      }
      if (way.partner >= 0 && !way.connected) {
        int error = 0;
        socklen_t len = sizeof(error);
        getsockopt(way.fd, SOL_SOCKET, SO_ERROR, &error, &len);
        const std::string& hello = dials[way.dial].hello;
        if (error != 0 || send(way.fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
          const int why = error != 0 ? error : errno;
          lost(way, std::strerror(why), why == ECONNREFUSED);
          close_way(i);
          continue;
        }
        way.connected = true;
        continue;
      }
      const size_t want = way.partner >= 0 ? kAnswerBytes : kHelloBytes;
      char buffer[kHelloBytes];
      const ssize_t n = recv(way.fd, buffer, want - way.got.size(), MSG_DONTWAIT);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (way.partner >= 0) lost(way, "closed before answering", false);
        close_way(i);
        continue;
      }
      way.got.append(buffer, static_cast<size_t>(n));
      if (way.got.size() < want) continue;
      const uint32_t magic = U32At(way.got, 0), who = U32At(way.got, 4);
      if (way.partner >= 0) {  // the answer of a partner below
        if (magic != kMagic || static_cast<int>(who) != way.partner) {
          lost(way, "answered by something other than rank " + std::to_string(way.partner), true);
          close_way(i);
          continue;
        }
        dials[way.dial].waiting = false;
        adopt(way.partner, way.fd);
        ways.erase(ways.begin() + static_cast<std::ptrdiff_t>(i));
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
      ways.erase(ways.begin() + static_cast<std::ptrdiff_t>(i));
    }
    // New connections, after the pass above (whose indices they would shift). Past
    // kMaxUnverified the oldest unverified one goes: a stranger cannot make this rank hold
    // more, and a partner pushed out by a flood dials again.
    if (fds[0].revents & POLLIN) {
      while (true) {
        const int fd = accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          throw SystemError("accept its partners");
        }
        const auto unverified = std::count_if(ways.begin(), ways.end(), [](const Pending& w) { return w.partner < 0; });
        if (unverified >= kMaxUnverified) {
          close_way(static_cast<size_t>(std::find_if(ways.begin(), ways.end(), [](const Pending& w) { return w.partner < 0; }) -
                                        ways.begin()));
        }
        ways.push_back(Pending{fd, -1, 0, false, std::string()});
      }
    }
  }
  close(listener_);
  listener_ = -1;
  const std::vector<int> left = missing();
  if (left.empty()) return;
  std::ostringstream seconds;
  seconds << timeout_s_;
  std::string why = "rank " + std::to_string(rank_) + " could not connect its control link to ";
  for (size_t i = 0; i < left.size(); ++i) {
    why += (i ? ", rank " : "rank ") + std::to_string(left[i]);
    auto error = last_error.find(left[i]);
    why += error != last_error.end() ? " (" + error->second + ")"
                                     : (left[i] > rank_ ? " (it never connected)" : " (no answer)");
  }
  throw std::runtime_error(why + (unreachable() ? "" : " within " + seconds.str() + " s"));
}

}  // namespace hvdlite
