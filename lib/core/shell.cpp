#include "core/shell.hpp"

#include "core/knobs.hpp"

namespace ddp {
namespace shell {

std::string& last_error() {
  thread_local std::string text;
  return text;
}

HookScope& running_hook() {
  thread_local HookScope scope;
  return scope;
}

// A context is never entered from its own comm hook: the thread that launched or waits for the
// bucket may hold the context's lock (a host hook runs on a bucket worker while ddp_finish_backward
// waits for it; a GPU hook runs inside ddp_grad_ready), so such a call could only deadlock.
void refuse_reentry(ddp_t d) {
  const HookScope& h = running_hook();
  if (d && h.context && h.context == d->impl.get())
    fail(DDP_ERR_INVALID_STATE,
         "called from inside this context's comm hook (bucket %d): a hook may call only ddp_comm_allreduce on "
         "bucket->comm",
         h.call->bucket);
}

Context& context_of(ddp_t d) {
  if (!d) fail(DDP_ERR_INVALID_ARGUMENT, "the ddp_t handle is NULL");
  refuse_reentry(d);
  return *d->impl;
}

Comm& comm_of(ddp_comm_t c) {
  if (!c) fail(DDP_ERR_INVALID_ARGUMENT, "the ddp_comm_t handle is NULL");
  return c->get();
}

ddp_comm_t wrap(std::unique_ptr<Comm> c) {
  ddp_comm_t h = new ddp_comm;
  h->impl = std::move(c);
  return h;
}

const char* status_name(int status) {
  switch (status) {
#define DDP_STATUS_CASE_(name, value, text) \
  case name: return text;
    DDP_STATUS_MAP(DDP_STATUS_CASE_)
#undef DDP_STATUS_CASE_
    default: return "unknown status";
  }
}

int64_t default_init_timeout_ms() { return knobs::init_timeout_ms(); }

}  // namespace shell
}  // namespace ddp
