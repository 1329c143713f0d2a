// The sockets under the rendezvous store (host/tcp.hpp): a client that retries a port nobody listens
// on yet never ends up connected to itself, and the listener that comes later gets the port; a
// listener outlasts a port taken for a moment and refuses, by name, one that stays taken. The stall
// inspector's ask tells a stopped process (its port accepts, nothing answers) from a gone one.
#include <doctest.h>

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <string>
#include <thread>

#include "core/common.hpp"

#include "core/inspector.hpp"
#include "host/probe.hpp"
#include "host/tcp.hpp"
#include "../support/ports.hpp"

namespace {

// A port the kernel hands to connect() on loopback, nobody listening on it: the one after a port that
// bind() was given (Linux gives odd ports to bind and tries even ones first for connect), if free.
int connectable_free_port() {
  for (int tries = 0; tries < 100; ++tries) {
    const int port = ddp_test::free_port() + 1;
    bool refused = false;
    ddp::tcp::Socket s = ddp::tcp::try_connect("127.0.0.1", port, ddp::Deadline::after_ms(1000), &refused);
    if (port > 1 && port < 65536 && !s.valid() && refused && ddp_test::sockets_holding(port) == 0) return port;
  }
  return 0;
}

}  // namespace

TEST_CASE("tcp: a client retrying a port nobody listens on never connects to itself; the listener gets the port") {
  using namespace ddp;
  const int port = connectable_free_port();
  REQUIRE(port > 0);
  // Without the guard, a loopback client meets its own port within one sweep of the even ephemeral
  // ports (here 700 to 24,000 attempts): 100,000 attempts, or 10 s on a slow machine.
  const auto stop = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int attempts = 0, connected = 0, not_refused = 0;
  for (; attempts < 100000 && std::chrono::steady_clock::now() < stop; ++attempts) {
    bool refused = false;
    tcp::Socket s = tcp::try_connect("127.0.0.1", port, Deadline::after_ms(1000), &refused);
    if (!refused) ++not_refused;
    if (s.valid() && ++connected) break;
  }
  INFO("port " << port << ", " << attempts << " attempts");
  CHECK(connected == 0);
  CHECK(not_refused == 0);
  // The port is free for the listener that comes later, and a client reaches it; unless another
  // connection took it as its local port meanwhile (connect() may take any port of the range, and the
  // attempts above cannot leave one: every one was refused), which is no defect of the guard.
  tcp::Socket listener;
  try {
    listener = tcp::listen_on(port, "test listener");
  } catch (const Error& e) {
    INFO("error: " << e.what());
    REQUIRE(ddp_test::sockets_holding(port) > 0);
    MESSAGE("port " << port << " became another connection's own port during the test; listener part left out");
    return;
  }
  CHECK(tcp::bound_port(listener) == port);
  tcp::Socket c = tcp::connect_to("127.0.0.1", port, Deadline::after_ms(5000), "test client");
  tcp::Socket a = tcp::accept_within(listener, 5000);
  CHECK(c.valid());
  CHECK(a.valid());
}

TEST_CASE("tcp: listen_on waits out a port taken for a moment, and names a port that stays taken") {
  using namespace ddp;
  const int port = ddp_test::free_port();
  REQUIRE(port > 0);
  {
    // Taken for 150 ms (as by a client that reached its own port and lets go): the listener gets it.
    tcp::Socket other = tcp::listen_on(port, "the other listener");
    std::thread release([&other] {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      other.close();
    });
    const auto t0 = std::chrono::steady_clock::now();
    bool got = false;
    try {
      tcp::Socket mine = tcp::listen_on(port, "test listener");
      got = tcp::bound_port(mine) == port;
    } catch (const Error& e) {
      INFO("error: " << e.what());
      CHECK(false);
    }
    release.join();
    CHECK(got);
    CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(100));
  }
  {
    // Taken throughout: refused within about half a second, naming the port.
    tcp::Socket other = tcp::listen_on(port, "the other listener");
    const auto t0 = std::chrono::steady_clock::now();
    ddp_status_t status = DDP_SUCCESS;
    std::string message;
    try {
      tcp::listen_on(port, "test listener");
    } catch (const Error& e) {
      status = e.status();
      message = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - t0;
    CHECK(status == DDP_ERR_INVALID_ARGUMENT);
    INFO("message: " << message);
    CHECK(message.find("test listener: cannot listen on port " + std::to_string(port)) != std::string::npos);
    CHECK(waited >= std::chrono::milliseconds(400));
    CHECK(waited < std::chrono::seconds(3));
  }
}

TEST_CASE("peer watch: a port that accepts but never answers is a stopped process; a closed one is gone") {
  using namespace ddp;
  tcp::Socket listener = tcp::listen_on(0, "a stopped rank's port");  // listens; nobody ever accepts
  const int port = tcp::bound_port(listener);
  const auto t0 = std::chrono::steady_clock::now();
  const Position stopped = ask_rank("127.0.0.1", port, 1, Deadline::after_ms(300));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(stopped.iteration == kAcceptedSilent);      // the peer watch leaves it to timeout_ms
  CHECK(liveness_of(stopped) == Liveness::Silent);  // a recovery still cannot count on it
  CHECK(ms < 2000);
  listener = tcp::Socket();
  const Position gone = ask_rank("127.0.0.1", port, 2, Deadline::after_ms(300));
  CHECK(gone.iteration == -2);
  CHECK(liveness_of(gone) == Liveness::Gone);
}

TEST_CASE("test support: the sockets holding a port, this process's or another's, are counted") {
  using namespace ddp;
  tcp::Socket mine = tcp::listen_on(0, "this process's listener");
  const int my_port = tcp::bound_port(mine);
  int of_mine = -1;
  CHECK(ddp_test::sockets_holding(my_port, &of_mine) >= 1);  // IPv4 and IPv6 tables may both list it
  CHECK(of_mine == ddp_test::sockets_holding(my_port));
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const int their_port = ddp_test::free_port();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // only system calls here: the child of a threaded process
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(their_port));
    const char ok = (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd, 1) == 0) ? 1 : 0;
    (void)!::write(ready[1], &ok, 1);
    ::pause();
    ::_exit(0);
  }
  char ok = 0;
  CHECK(::read(ready[0], &ok, 1) == 1);
  CHECK(ok == 1);
  CHECK(ddp_test::sockets_holding(their_port, &of_mine) == 1);
  CHECK(of_mine == 0);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  CHECK(ddp_test::sockets_holding(their_port) == 0);
}
