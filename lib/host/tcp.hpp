// TCP sockets with deadlines: the rendezvous store and the stall inspector's exchange of host
// communicators that have no MPI under them (Gloo). Every wait is bounded; every failure throws a
// typed Error whose message says what was being done and with whom.
#pragma once

#include <cstddef>
#include <string>

#include "core/common.hpp"

namespace ddp {
namespace tcp {

// An owned socket descriptor, closed on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close();

 private:
  int fd_ = -1;
};

// Listens on `port` (0: any free port) of every interface, with room for `backlog` connections not
// accepted yet. Throws DDP_ERR_INVALID_ARGUMENT naming the port when it cannot (in use for half a
// second, not permitted).
Socket listen_on(int port, const std::string& what, int backlog = 128);
// The port a listening socket is bound to.
int bound_port(const Socket& s);
// Accepts one connection if one is waiting within `wait_ms`; an invalid Socket otherwise.
Socket accept_within(const Socket& listener, int wait_ms);

// Whether `s` has bytes (or an end of file) to read within `wait_ms`.
bool readable_within(const Socket& s, int wait_ms);
// Whether a peer that should be silent (it waits for an answer) sent or closed something: it left.
bool hung_up(const Socket& s);

// Connects to host:port, trying again until the deadline while nobody listens there yet (the
// listening rank may start later). Throws DDP_ERR_TIMEOUT at the deadline, naming `what`.
Socket connect_to(const std::string& host, int port, Deadline dl, const std::string& what);
// One connection attempt that gives up at the deadline or at the first refusal: an invalid Socket.
// *refused (may be NULL): whether the host answered that nothing listens on the port. A socket that
// reached its own port (nobody listened: TCP's simultaneous open on loopback) counts as refused.
Socket try_connect(const std::string& host, int port, Deadline dl, bool* refused = nullptr);

// Sends or receives exactly `n` bytes by the deadline. Throws DDP_ERR_TIMEOUT at the deadline and
// when the peer closed the connection, naming `what`.
void send_all(const Socket& s, const void* p, size_t n, Deadline dl, const std::string& what);
void recv_all(const Socket& s, void* p, size_t n, Deadline dl, const std::string& what);

// The numeric address of this end of a connected socket (the interface that reaches the peer).
std::string local_address(const Socket& s);
// The first IPv4 (else IPv6) address of the network interface `ifname`, "" if it has none.
std::string interface_address(const std::string& ifname);

// Milliseconds left before the deadline, at least 1 and at most `forever` (also what an infinite one gives).
int64_t ms_left(Deadline dl, int64_t forever);

}  // namespace tcp
}  // namespace ddp
