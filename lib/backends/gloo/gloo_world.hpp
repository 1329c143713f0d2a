// The Gloo communicator's shared pieces (lib/backends/gloo): the world every communicator of a job
// meets in (the rendezvous store and the TCP device their contexts share), Gloo's bounds, and
// gloo_call, which turns Gloo's exceptions into ours. The files: gloo_world (opening a world),
// gloo_mesh (a Gloo context's full mesh, made through the store), gloo_ring_link (the ring over
// Gloo's buffers), gloo_comm (the communicator and its collectives), gloo_elastic (agreeing on a new
// membership, admitting joiners), gloo_join (the join desk and a joiner's communicator).
#pragma once

#include <gloo/transport/device.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/gloo/gloo_errors.hpp"
#include "core/common.hpp"
#include "host/rendezvous.hpp"
#include "host/sigpipe.hpp"
#include "host/tcp.hpp"

namespace ddp {

using GlooMs = std::chrono::milliseconds;
// "Forever" for Gloo, whose waits always take a bound: 30 days.
constexpr int64_t kGlooForeverMs = int64_t(30) * 24 * 3600 * 1000;

inline GlooMs gloo_left(Deadline dl) { return GlooMs(tcp::ms_left(dl, kGlooForeverMs)); }

// The ranks' meeting place and the TCP device their contexts share.
struct GlooWorld {
  std::string method;
  Rendezvous rv;
  std::shared_ptr<gloo::transport::Device> device;
  int64_t init_timeout_ms = 0;       // the creation's bound, also that of duplicates and probers
  std::atomic<int> comms{0};         // communicators made over it so far (the same count on every rank)
  std::atomic<bool> settled{false};  // the arrival's keys erased (rank 0, after the first barrier)
};

// Runs a Gloo call, turning its exceptions into ours (rethrow_gloo_failure). A write to a dead peer
// fails instead of raising SIGPIPE (host/sigpipe.hpp); Gloo's event loop, started by the device's
// creation here, keeps SIGPIPE blocked.
template <class F>
inline void gloo_call(int rank, int size, const std::string& what, F&& f) {
  host::SigpipeBlock no_sigpipe;
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (...) {
    rethrow_gloo_failure(rank, size, what);
  }
}

// The world of `init_method` for this rank, opened once per process and shared by the communicators
// made the same way. `joining`: a process that joins a running elastic job (a world of its own).
std::shared_ptr<GlooWorld> open_world(const char* init_method, int rank, int size, int64_t timeout_ms, Deadline dl,
                                      bool joining = false);

}  // namespace ddp
