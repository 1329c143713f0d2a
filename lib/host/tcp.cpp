#include "host/tcp.hpp"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace ddp {
namespace tcp {

Socket::~Socket() { close(); }

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int64_t ms_left(Deadline dl, int64_t forever) {
  if (dl.infinite()) return forever;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(dl.at() - Deadline::Clock::now()).count();
  return std::min(std::max<int64_t>(1, left), forever);  // a wait longer than "forever" is forever
}

namespace {

int poll_ms(Deadline dl) { return static_cast<int>(std::min<int64_t>(ms_left(dl, 100), 100)); }

// Waits until `fd` is readable (POLLIN) or writable (POLLOUT), or the deadline passes: false then.
bool wait_fd(int fd, short events, Deadline dl) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, poll_ms(dl));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // let the read or write report the error
    if (dl.passed()) return false;
  }
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

// A connection to a port nobody listens on, from the same port (TCP's simultaneous open): possible on
// loopback when the port lies in the kernel's ephemeral range (Linux hands even ports to connect(), and
// MASTER_PORT + 1 of an odd free port is even). The "store" would then answer with this rank's own
// requests, and its listener could not bind the port.
bool connected_to_itself(int fd) {
  sockaddr_storage mine{}, peer{};
  socklen_t a = sizeof mine, b = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &a) != 0) return false;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &b) != 0) return false;
  return a == b && std::memcmp(&mine, &peer, a) == 0;
}

// Closes with a reset, so that the port is free at once (no TIME_WAIT left on it).
void close_at_once(Socket& s) {
  linger l{1, 0};
  ::setsockopt(s.fd(), SOL_SOCKET, SO_LINGER, &l, sizeof l);
  s.close();
}

}  // namespace

Socket listen_on(int port, const std::string& what, int backlog) {
  Socket s(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  bool v6 = s.valid();
  if (!v6) s = Socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) fail(DDP_ERR_INVALID_ARGUMENT, "%s: socket() failed: %s", what.c_str(), std::strerror(errno));
  int one = 1, zero = 0;
  ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (v6) ::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 clients too
  sockaddr_in6 a6{};
  a6.sin6_family = AF_INET6;
  a6.sin6_addr = in6addr_any;
  a6.sin6_port = htons(static_cast<uint16_t>(port));
  sockaddr_in a4{};
  a4.sin_family = AF_INET;
  a4.sin_addr.s_addr = htonl(INADDR_ANY);
  a4.sin_port = htons(static_cast<uint16_t>(port));
  const sockaddr* a = v6 ? reinterpret_cast<sockaddr*>(&a6) : reinterpret_cast<sockaddr*>(&a4);
  const socklen_t len = v6 ? sizeof a6 : sizeof a4;
  // A port still taken a moment later is taken: the retries only outlast a client that reached this
  // port from itself while nobody listened (it lets go at once, see connected_to_itself).
  int rc = ::bind(s.fd(), a, len);
  for (int tries = 0; rc != 0 && errno == EADDRINUSE && port != 0 && tries < 25; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    rc = ::bind(s.fd(), a, len);
  }
  if (rc != 0 || ::listen(s.fd(), backlog) != 0)
    fail(DDP_ERR_INVALID_ARGUMENT, "%s: cannot listen on port %d: %s", what.c_str(), port, std::strerror(errno));
  set_nonblocking(s.fd());
  return s;
}

int bound_port(const Socket& s) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

Socket accept_within(const Socket& listener, int wait_ms) {
  pollfd p{listener.fd(), POLLIN, 0};
  if (::poll(&p, 1, wait_ms) <= 0) return Socket();
  Socket c(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (c.valid()) {
    int one = 1;
    ::setsockopt(c.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return c;
}

bool readable_within(const Socket& s, int wait_ms) {
  pollfd p{s.fd(), POLLIN, 0};
  return ::poll(&p, 1, wait_ms) != 0;
}

bool hung_up(const Socket& s) {
  pollfd p{s.fd(), POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

Socket try_connect(const std::string& host, int port, Deadline dl, bool* refused) {
  if (refused) *refused = false;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  if (::getaddrinfo(host.c_str(), service.c_str(), &hints, &res) != 0 || !res) return Socket();
  Socket out;
  for (addrinfo* ai = res; ai && !out.valid(); ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) continue;
    set_nonblocking(s.fd());
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    int err = rc == 0 ? 0 : errno;
    if (rc != 0 && errno == EINPROGRESS && wait_fd(s.fd(), POLLOUT, dl)) {
      socklen_t len = sizeof err;
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
    }
    if (rc == 0 && connected_to_itself(s.fd())) {
      close_at_once(s);  // nobody listens there: as if refused
      rc = -1, err = ECONNREFUSED;
    }
    if (rc != 0 && err == ECONNREFUSED && refused) *refused = true;
    if (rc == 0) out = std::move(s);
  }
  ::freeaddrinfo(res);
  if (out.valid()) {
    int one = 1;
    ::setsockopt(out.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return out;
}

Socket connect_to(const std::string& host, int port, Deadline dl, const std::string& what) {
  for (;;) {
    Socket s = try_connect(host, port, dl);
    if (s.valid()) return s;
    if (dl.passed())
      fail(DDP_ERR_TIMEOUT, "%s: nobody listened on %s:%d before the timeout", what.c_str(), host.c_str(), port);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void send_all(const Socket& s, const void* p, size_t n, Deadline dl, const std::string& what) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::send(s.fd(), c, n, MSG_NOSIGNAL);
    if (k > 0) {
      c += k;
      n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_fd(s.fd(), POLLOUT, dl)) fail(DDP_ERR_TIMEOUT, "%s: sending timed out", what.c_str());
    } else {
      fail(DDP_ERR_TIMEOUT, "%s: the connection broke: %s", what.c_str(), std::strerror(errno));
    }
  }
}

void recv_all(const Socket& s, void* p, size_t n, Deadline dl, const std::string& what) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = ::recv(s.fd(), c, n, 0);
    if (k > 0) {
      c += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      fail(DDP_ERR_TIMEOUT, "%s: the peer closed the connection (its process exited or was killed)", what.c_str());
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_fd(s.fd(), POLLIN, dl)) fail(DDP_ERR_TIMEOUT, "%s: no answer before the timeout", what.c_str());
    } else {
      fail(DDP_ERR_TIMEOUT, "%s: the connection broke: %s", what.c_str(), std::strerror(errno));
    }
  }
}

std::string interface_address(const std::string& ifname) {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return std::string();
  std::string v4, v6;
  for (ifaddrs* i = all; i; i = i->ifa_next) {
    if (!i->ifa_addr || !i->ifa_name || ifname != i->ifa_name) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char host[NI_MAXHOST] = "";
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::getnameinfo(i->ifa_addr, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) continue;
    std::string& first = family == AF_INET ? v4 : v6;
    if (first.empty()) first = host;
  }
  ::freeifaddrs(all);
  return v4.empty() ? v6 : v4;
}

std::string local_address(const Socket& s) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  char host[NI_MAXHOST] = "";
  if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&a), &len) != 0 ||
      ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0)
    return std::string();
  std::string h = host;
  if (h.compare(0, 7, "::ffff:") == 0) h = h.substr(7);  // an IPv4 peer seen through a dual-stack socket
  return h;
}

}  // namespace tcp
}  // namespace ddp
