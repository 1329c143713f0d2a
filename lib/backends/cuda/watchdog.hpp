// The CUDA backend's watchdog: one thread that checks enqueued GPU work against its deadlines, since
// no libddp call may be running (or polling) when a collective stalls.
#pragma once

namespace ddp {

// Something whose enqueued GPU work the watchdog checks against deadlines, from its own thread.
class Watched {
 public:
  virtual ~Watched() = default;
  // Called by the watchdog thread every few milliseconds: aborts what is late.
  virtual void scan() = 0;
};
// The process's watchdog thread (started on first use): scans every registered item until it is
// unregistered; unregister returns once no scan of it runs.
void watchdog_register(Watched* w);
void watchdog_unregister(Watched* w);

}  // namespace ddp
