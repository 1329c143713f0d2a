// ddp_store: hosts a job's rendezvous store in a process of its own, so that it outlives every rank
// (an elastic job must be able to lose rank 0, which otherwise serves the store). The ranks meet over
// env:// or tcp://HOST:PORT as usual, with DDP_STORE_EXTERNAL=1 so that rank 0 connects to this store
// instead of serving one. tools/ddp_launch --elastic starts it on the job's store port.
//
//   ddp_store PORT       serves on PORT (0: any free port) until SIGTERM or SIGINT; prints
//                        "ddp_store: listening on port P" once it listens. What it served so far
//                        ("ddp_store: 12 requests, 340 bytes in, ...": requests, bytes each way,
//                        connections and their peak, wake-ups of waiting requests) goes to stderr on
//                        SIGUSR1 and at exit.
#include <signal.h>

#include <cstdio>
#include <cstring>

#include "core/knobs.hpp"
#include "host/store_tcp.hpp"

namespace {

void print_counters(const ddp::StoreServer& server, const char* when) {
  std::fprintf(stderr, "ddp_store: %s (%s)\n", ddp::describe(server.counters()).c_str(), when);
  std::fflush(stderr);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t port = -1;
  if (argc != 2 || !ddp::knobs::parse_integer(argv[1], 0, 65535, &port)) {
    std::fprintf(stderr, "usage: ddp_store PORT   (0..65535; 0: any free port)\n");
    return 2;
  }
  // The signals are taken by sigwait alone (blocked before the server's thread starts, which inherits
  // the mask): the main thread sleeps until one comes.
  sigset_t signals;
  sigemptyset(&signals);
  for (int s : {SIGTERM, SIGINT, SIGUSR1}) sigaddset(&signals, s);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a rank that dies mid-answer must not end the store
  try {
    ddp::StoreServer server(static_cast<int>(port));
    std::printf("ddp_store: listening on port %d\n", server.port());
    std::fflush(stdout);
    for (;;) {
      int s = 0;
      if (sigwait(&signals, &s) != 0) continue;
      if (s != SIGUSR1) break;
      print_counters(server, "SIGUSR1");
    }
    print_counters(server, "at exit");
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "ddp_store: %s\n", e.what());
    return 1;
  }
  return 0;
}
