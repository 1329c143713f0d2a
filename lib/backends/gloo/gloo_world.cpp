// Opening a Gloo world: the rendezvous store and the TCP device, once per init method and rank in a
// process (gloo_world.hpp).
#include "backends/gloo/gloo_world.hpp"

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/transport/tcp/device.h>

#include <cstring>

#include <map>
#include <mutex>

#include "core/knobs.hpp"

namespace ddp {

namespace {

// The worlds in use, by init method, rank and size: a second communicator made the same way meets
// over the same store (rank 0 cannot listen twice on one port) as the next communicator of that world.
// Each name has its own lock, held while its world is opened: ranks that are threads of one process
// open their worlds at once (rank 1 waits for rank 0's store while rank 0 starts it).
struct WorldSlot {
  std::mutex mu;
  std::weak_ptr<GlooWorld> world;
};
std::mutex g_worlds_mu;
std::map<std::string, std::shared_ptr<WorldSlot>> g_worlds;

}  // namespace

std::shared_ptr<GlooWorld> open_world(const char* init_method, int rank, int size, int64_t timeout_ms, Deadline dl,
                                      bool joining) {
  // The same world whether its method or rank is named or left to the defaults and the environment.
  auto env = [](const char* k) { return knobs::text(k); };
  const std::string name = (init_method && *init_method ? init_method : "env://") + std::string("|") +
                           (joining ? std::string("joining")
                                    : (rank >= 0 ? std::to_string(rank) : env("RANK")) + "|" +
                                          (size >= 0 ? std::to_string(size) : env("WORLD_SIZE")));
  std::shared_ptr<WorldSlot> slot;
  {
    std::lock_guard<std::mutex> lock(g_worlds_mu);
    std::shared_ptr<WorldSlot>& s = g_worlds[name];
    if (!s) s = std::make_shared<WorldSlot>();
    slot = s;
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (std::shared_ptr<GlooWorld> w = slot->world.lock()) return w;
  auto w = std::make_shared<GlooWorld>();
  w->rv = joining ? open_joining_store(init_method, dl) : open_rendezvous(init_method, rank, size, dl);
  w->init_timeout_ms = timeout_ms;
  w->settled = joining;  // a joiner made no arrival
  gloo::transport::tcp::attr attr;
  const std::string iface = knobs::text("GLOO_SOCKET_IFNAME");
  if (!iface.empty()) {
    attr.iface = iface;
    // The stall inspector's port is reached where Gloo is (the store's address or the host name may
    // be another interface's, out of the peers' reach).
    const std::string a = tcp::interface_address(iface);
    if (!a.empty()) w->rv.host = a;
  } else
    attr.hostname = w->rv.host;  // the interface that reaches rank 0 (empty: the host's name)
  gloo_call(w->rv.rank, w->rv.size, "device on " + (attr.iface.empty() ? attr.hostname : attr.iface),
            [&] { w->device = gloo::transport::tcp::CreateDevice(attr); });
  slot->world = w;
  return w;
}

// A failure of a peer's connection or a wait (Gloo's IoException) is fatal to the context and
// reported as a timeout naming what was waited for; a failed check of Gloo's (EnforceNotMet: the
// ranks disagree on the world or a collective's sizes) is DDP_ERR_MISMATCH; anything else
// DDP_ERR_INTERNAL. Neither of the last two is labelled a timeout. One check is the transport's own:
// its event loop refused a connection whose socket had just been closed (a peer died while this rank
// posted to it): that is the peer's loss, reported as the connection failures are.
void rethrow_gloo_failure(int rank, int size, const std::string& what) {
  try {
    throw;
  } catch (const gloo::IoException& e) {
    fail(DDP_ERR_TIMEOUT,
         "rank %d of %d: Gloo %s failed (a rank died, stalled past the timeout or issued a "
         "different collective): %s",
         rank, size, what.c_str(), e.what());
  } catch (const gloo::EnforceNotMet& e) {
    if (std::strstr(e.what(), "epoll_ctl") != nullptr)
      fail(DDP_ERR_TIMEOUT, "rank %d of %d: Gloo %s failed (a peer's connection closed under it: a rank died): %s",
           rank, size, what.c_str(), e.what());
    fail(DDP_ERR_MISMATCH,
         "rank %d of %d: Gloo %s failed a consistency check (the ranks disagree on the world size or on a "
         "collective's sizes): %s",
         rank, size, what.c_str(), e.what());
  } catch (const std::exception& e) {
    fail(DDP_ERR_INTERNAL, "rank %d of %d: Gloo %s failed: %s", rank, size, what.c_str(), e.what());
  }
}

}  // namespace ddp
