// host::SigpipeBlock: a write to a socket whose peer is gone fails with EPIPE instead of raising
// SIGPIPE (whose default action would end a survivor of a dead rank without a word). Each case
// counts deliveries with a handler of its own, so a missing block shows as a delivered signal.
#include <doctest.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <thread>

#include "host/sigpipe.hpp"

namespace {

std::atomic<int> g_delivered{0};

// Counts SIGPIPE deliveries while it lives; puts the old disposition back.
class CountSigpipe {
 public:
  CountSigpipe() {
    g_delivered = 0;
    struct sigaction sa {};
    sa.sa_handler = [](int) { g_delivered.fetch_add(1); };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPIPE, &sa, &old_);
  }
  ~CountSigpipe() { sigaction(SIGPIPE, &old_, nullptr); }

 private:
  struct sigaction old_ {};
};

// A socket whose peer has closed: the first write to it raises SIGPIPE.
class BrokenSocket {
 public:
  BrokenSocket() {
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_) == 0);
    close(fds_[1]);
  }
  ~BrokenSocket() { close(fds_[0]); }
  // write(2)'s result and errno, as Gloo's writev sees them.
  int write_errno() const {
    const char byte = 1;
    errno = 0;
    return write(fds_[0], &byte, 1) < 0 ? errno : 0;
  }

 private:
  int fds_[2] = {-1, -1};
};

bool blocked_here() {
  sigset_t now;
  sigemptyset(&now);
  pthread_sigmask(SIG_BLOCK, nullptr, &now);
  return sigismember(&now, SIGPIPE) == 1;
}

bool pending_here() {
  sigset_t p;
  sigemptyset(&p);
  sigpending(&p);
  return sigismember(&p, SIGPIPE) == 1;
}

void take_pending_sigpipe() {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  const timespec now{0, 0};
  sigtimedwait(&pipe, nullptr, &now);
}

}  // namespace

TEST_CASE("sigpipe: the probe itself raises SIGPIPE without a block (the cases below can fail)") {
  CountSigpipe count;
  BrokenSocket sock;
  CHECK(sock.write_errno() == EPIPE);
  CHECK(g_delivered == 1);
}

TEST_CASE("sigpipe: a write to a gone peer fails with EPIPE, nothing is delivered or left pending") {
  CountSigpipe count;
  BrokenSocket sock;
  REQUIRE_FALSE(blocked_here());
  {
    ddp::host::SigpipeBlock block;
    CHECK(blocked_here());
    CHECK(sock.write_errno() == EPIPE);
    CHECK(sock.write_errno() == EPIPE);  // twice: one pending signal, taken once
  }
  CHECK_FALSE(blocked_here());
  CHECK_FALSE(pending_here());
  CHECK(g_delivered == 0);
}

TEST_CASE("sigpipe: blocks nest; only the outermost puts the mask back") {
  CountSigpipe count;
  BrokenSocket sock;
  {
    ddp::host::SigpipeBlock outer;
    {
      ddp::host::SigpipeBlock inner;
      CHECK(sock.write_errno() == EPIPE);
    }
    CHECK(blocked_here());
    CHECK(sock.write_errno() == EPIPE);
  }
  CHECK_FALSE(blocked_here());
  CHECK(g_delivered == 0);
}

TEST_CASE("sigpipe: a thread that blocked SIGPIPE itself keeps its mask and its pending signal") {
  CountSigpipe count;
  BrokenSocket sock;
  bool still_blocked = false, still_pending = false;
  std::thread t([&] {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    { ddp::host::SigpipeBlock block; }
    sock.write_errno();
    { ddp::host::SigpipeBlock block; }
    still_blocked = blocked_here();
    still_pending = pending_here();
    take_pending_sigpipe();
  });
  t.join();
  CHECK(still_blocked);
  CHECK(still_pending);
  CHECK(g_delivered == 0);
}

TEST_CASE("sigpipe: a thread started inside a block (Gloo's event loop) keeps SIGPIPE blocked") {
  CountSigpipe count;
  BrokenSocket sock;
  int err = 0;
  bool blocked = false;
  std::thread t;
  {
    ddp::host::SigpipeBlock block;
    t = std::thread([&] {
      blocked = blocked_here();
      err = sock.write_errno();
      take_pending_sigpipe();
    });
  }
  t.join();
  CHECK(blocked);
  CHECK(err == EPIPE);
  CHECK(g_delivered == 0);
  CHECK_FALSE(blocked_here());
}

TEST_CASE("sigpipe: other signals blocked inside a block stay blocked after it") {
  sigset_t usr;
  sigemptyset(&usr);
  sigaddset(&usr, SIGUSR2);
  {
    ddp::host::SigpipeBlock block;
    pthread_sigmask(SIG_BLOCK, &usr, nullptr);
  }
  sigset_t now;
  sigemptyset(&now);
  pthread_sigmask(SIG_BLOCK, nullptr, &now);
  CHECK(sigismember(&now, SIGUSR2) == 1);
  CHECK(sigismember(&now, SIGPIPE) == 0);
  pthread_sigmask(SIG_UNBLOCK, &usr, nullptr);
}
