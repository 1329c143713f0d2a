// ddp_store: hosts a job's rendezvous store in a process of its own, so that it outlives every rank
// (an elastic job must be able to lose rank 0, which otherwise serves the store). The ranks meet over
// env:// or tcp://HOST:PORT as usual, with DDP_STORE_EXTERNAL=1 so that rank 0 connects to this store
// instead of serving one. tools/ddp_launch --elastic starts it on the job's store port.
//
//   ddp_store PORT       serves on PORT (0: any free port) until SIGTERM or SIGINT; prints
//                        "ddp_store: listening on port P" once it listens.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/knobs.hpp"
#include "host/store_tcp.hpp"

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }
}  // namespace

int main(int argc, char** argv) {
  int64_t port = -1;
  if (argc != 2 || !ddp::knobs::parse_integer(argv[1], 0, 65535, &port)) {
    std::fprintf(stderr, "usage: ddp_store PORT   (0..65535; 0: any free port)\n");
    return 2;
  }
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a rank that dies mid-answer must not end the store
  try {
    ddp::serve_store(
        static_cast<int>(port),
        [](int p) {
          std::printf("ddp_store: listening on port %d\n", p);
          std::fflush(stdout);
        },
        [] { return g_stop.load(); });
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "ddp_store: %s\n", e.what());
    return 1;
  }
  return 0;
}
