// The TCP store's server: one thread runs an event loop (epoll) over the listening socket and every
// connection, all non-blocking, each with its own input and output buffers. A request is handled as
// soon as its whole frame is in (a client that sends half a frame and stops holds nothing up); what
// waits for keys waits in the table (host/store_table.hpp), not in a thread, and is answered when a
// set reaches it or its bound passes: the loop sleeps in epoll_wait until a socket is ready or the
// next bound, and never looks at anything on a timer. Thousands of ranks cost a descriptor and two
// buffers each, where a thread per connection cost a stack and a wake-up at every set.
#include "host/store_tcp.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <errno.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "core/log.hpp"
#include "host/store_table.hpp"
#include "host/store_wire.hpp"
#include "host/tcp.hpp"

namespace ddp {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kListener = 0, kWake = 1;                   // epoll tags; connections are numbered from 2
constexpr size_t kReadChunk = size_t(64) << 10;                // bytes per read call
constexpr int kReadsPerTurn = 16;                              // then the other connections get their turn
constexpr auto kAcceptPause = std::chrono::milliseconds(100);  // out of descriptors: accept again after

struct Conn {
  int fd = -1;
  std::string in, out;
  size_t in_at = 0, out_at = 0;  // consumed input, sent output
  bool writing = false;          // waits for the socket to take more output (EPOLLOUT)
  bool closing = false;
};

}  // namespace

struct StoreServer::Impl {
  explicit Impl(int port);
  ~Impl();
  void run();
  void accept_all();
  void read_from(uint64_t tag, Conn& c);
  void parse(uint64_t tag, Conn& c);
  void flush(uint64_t tag, Conn& c);
  void send(uint64_t tag, std::string frame);
  void close_conn(uint64_t tag);
  void watch_fd(int op, int fd, uint32_t events, uint64_t tag) {
    epoll_event e{};
    e.events = events;
    e.data.u64 = tag;
    ::epoll_ctl(ep, op, fd, &e);
  }
  int wait_ms(Clock::time_point next) const;

  tcp::Socket listener;
  int ep = -1, wake = -1;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> requests{0}, bytes_in{0}, bytes_out{0}, accepted{0}, open{0}, peak{0}, wakeups{0};
  StoreTable table;
  std::unordered_map<uint64_t, Conn> conns;
  uint64_t next_tag = 2;
  std::vector<uint64_t> dirty, closing;  // connections with output to send, or to close, this turn
  bool accepting = true;
  Clock::time_point accept_again;
  std::thread thread;
};

StoreServer::Impl::Impl(int port)
    : listener(tcp::listen_on(port, "the rendezvous store (rank 0)", SOMAXCONN)),
      table([this](uint64_t tag, std::string frame) { send(tag, std::move(frame)); }) {
  ep = ::epoll_create1(EPOLL_CLOEXEC);
  wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (ep < 0 || wake < 0) {
    const int err = errno;
    if (ep >= 0) ::close(ep);
    if (wake >= 0) ::close(wake);
    fail(DDP_ERR_INTERNAL, "the rendezvous store (rank 0): cannot make its event loop: %s", std::strerror(err));
  }
  watch_fd(EPOLL_CTL_ADD, listener.fd(), EPOLLIN, kListener);
  watch_fd(EPOLL_CTL_ADD, wake, EPOLLIN, kWake);
  thread = std::thread([this] { run(); });
}

StoreServer::Impl::~Impl() {
  stop = true;
  const uint64_t one = 1;
  if (::write(wake, &one, sizeof one) < 0) {
  }
  thread.join();
  for (auto& c : conns) ::close(c.second.fd);
  ::close(ep);
  ::close(wake);
}

int StoreServer::Impl::wait_ms(Clock::time_point next) const {
  if (!accepting) next = std::min(next, accept_again);
  if (next == Clock::time_point::max()) return -1;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() + 1;
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, 1 << 30)));
}

void StoreServer::Impl::run() {
  std::vector<epoll_event> ev(256);
  Clock::time_point next = Clock::time_point::max();
  while (!stop.load()) {
    const int n = ::epoll_wait(ep, ev.data(), static_cast<int>(ev.size()), wait_ms(next));
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = ev[static_cast<size_t>(i)].data.u64;
      const uint32_t what = ev[static_cast<size_t>(i)].events;
      if (tag == kListener) {
        accept_all();
      } else if (tag == kWake) {
        uint64_t v = 0;
        if (::read(wake, &v, sizeof v) < 0) {
        }
      } else {
        auto it = conns.find(tag);
        if (it == conns.end()) continue;
        if (what & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_from(tag, it->second);
        if ((what & EPOLLOUT) && !it->second.closing) flush(tag, it->second);
      }
    }
    next = table.expire(Clock::now());
    if (!accepting && Clock::now() >= accept_again) {
      accepting = true;
      watch_fd(EPOLL_CTL_ADD, listener.fd(), EPOLLIN, kListener);
    }
    wakeups = table.wakeups();  // (before the answers go out: a client that has one sees its count)
    for (uint64_t tag : dirty) {
      auto it = conns.find(tag);
      if (it != conns.end() && !it->second.closing) flush(tag, it->second);
    }
    dirty.clear();
    for (uint64_t tag : closing) close_conn(tag);
    closing.clear();
  }
}

void StoreServer::Impl::accept_all() {
  for (;;) {
    const int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // The waiting connections stay in the backlog until a descriptor is free again.
        log(DDP_LOG_WARN, "the rendezvous store on port %d cannot accept more connections: %s (%llu open)",
            tcp::bound_port(listener), std::strerror(errno), static_cast<unsigned long long>(open.load()));
        watch_fd(EPOLL_CTL_DEL, listener.fd(), 0, kListener);
        accepting = false;
        accept_again = Clock::now() + kAcceptPause;
      }
      return;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    const uint64_t tag = next_tag++;
    conns[tag].fd = fd;
    watch_fd(EPOLL_CTL_ADD, fd, EPOLLIN, tag);
    ++accepted;
    peak = std::max(peak.load(), ++open);
  }
}

// Reads what the socket has (a bounded amount per turn), then handles every whole frame. A client
// that left is closed after its last requests were handled (a set followed by a close still counts).
void StoreServer::Impl::read_from(uint64_t tag, Conn& c) {
  char buf[kReadChunk];
  bool gone = false;
  for (int turn = 0; turn < kReadsPerTurn; ++turn) {
    const ssize_t k = ::recv(c.fd, buf, sizeof buf, 0);
    if (k > 0) {
      c.in.append(buf, static_cast<size_t>(k));
      bytes_in += static_cast<uint64_t>(k);
      if (static_cast<size_t>(k) < sizeof buf) break;
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else {
      gone = k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
      break;
    }
  }
  parse(tag, c);
  if (gone && !c.closing) {
    c.closing = true;
    closing.push_back(tag);
  }
}

// Every whole frame in the input, in order; a partial one waits for the rest.
void StoreServer::Impl::parse(uint64_t tag, Conn& c) {
  while (!c.closing && c.in.size() - c.in_at >= 4) {
    uint32_t len = 0;
    std::memcpy(&len, c.in.data() + c.in_at, 4);
    if (len < 5 || len > store_wire::kMaxFrame) {
      c.closing = true;
      closing.push_back(tag);
      break;
    }
    if (c.in.size() - c.in_at - 4 < len) break;
    ++requests;
    if (!table.handle(tag, c.in.data() + c.in_at + 4, len)) {
      c.closing = true;
      closing.push_back(tag);
    }
    c.in_at += 4 + size_t(len);
  }
  if (c.in_at == c.in.size()) {
    c.in.clear();
    c.in_at = 0;
  } else if (c.in_at > kReadChunk) {
    c.in.erase(0, c.in_at);
    c.in_at = 0;
  }
}

void StoreServer::Impl::send(uint64_t tag, std::string frame) {
  auto it = conns.find(tag);
  if (it == conns.end() || it->second.closing) return;
  Conn& c = it->second;
  if (c.out.empty() && !c.writing) dirty.push_back(tag);
  c.out += frame;
}

void StoreServer::Impl::flush(uint64_t tag, Conn& c) {
  while (c.out_at < c.out.size()) {
    const ssize_t k = ::send(c.fd, c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL);
    if (k > 0) {
      c.out_at += static_cast<size_t>(k);
      bytes_out += static_cast<uint64_t>(k);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!c.writing) watch_fd(EPOLL_CTL_MOD, c.fd, EPOLLIN | EPOLLOUT, tag);
      c.writing = true;
      return;
    } else {
      c.closing = true;
      closing.push_back(tag);
      return;
    }
  }
  c.out.clear();
  c.out_at = 0;
  if (c.writing) watch_fd(EPOLL_CTL_MOD, c.fd, EPOLLIN, tag);
  c.writing = false;
}

void StoreServer::Impl::close_conn(uint64_t tag) {
  auto it = conns.find(tag);
  if (it == conns.end()) return;
  table.drop(tag);
  watch_fd(EPOLL_CTL_DEL, it->second.fd, 0, tag);
  ::close(it->second.fd);
  conns.erase(it);
  --open;
}

StoreServer::StoreServer(int port) : impl_(new Impl(port)) {}

StoreServer::~StoreServer() {
  const StoreCounters c = counters();
  const int port = this->port();
  impl_.reset();
  log(DDP_LOG_INFO, "the rendezvous store on port %d served %s", port, describe(c).c_str());
}

int StoreServer::port() const { return tcp::bound_port(impl_->listener); }

StoreCounters StoreServer::counters() const {
  StoreCounters c;
  c.requests = impl_->requests, c.bytes_in = impl_->bytes_in, c.bytes_out = impl_->bytes_out;
  c.connections = impl_->accepted, c.peak_connections = impl_->peak, c.open_connections = impl_->open;
  c.wakeups = impl_->wakeups;
  return c;
}

std::string describe(const StoreCounters& c) {
  return format("%llu requests, %llu bytes in, %llu bytes out, %llu connections (peak %llu open), %llu wake-ups",
                static_cast<unsigned long long>(c.requests), static_cast<unsigned long long>(c.bytes_in),
                static_cast<unsigned long long>(c.bytes_out), static_cast<unsigned long long>(c.connections),
                static_cast<unsigned long long>(c.peak_connections), static_cast<unsigned long long>(c.wakeups));
}

}  // namespace ddp
