// The C ABI shell's common parts, shared by its files (api_comms.cpp: communicators; api_context.cpp:
// configs, contexts and their calls; api_hooks.cpp: the comm hook and the collective a hook calls).
// No exception crosses the shell: each entry point runs its body inside guard(__func__, ...), which
// turns any exception into a status and a message that starts with the entry point's name.
#pragma once

#include <memory>
#include <new>
#include <string>

#include "core/handles.hpp"
#include "ddp.h"

namespace ddp {
namespace shell {

// This thread's last detailed message (ddp_last_error).
std::string& last_error();

template <class F>
ddp_status_t guard(const char* fn, F&& body) {
  try {
    body();
    return DDP_SUCCESS;
  } catch (const Error& e) {
    last_error() = std::string(fn) + ": " + e.what();
    return e.status();
  } catch (const std::bad_alloc&) {
    last_error() = std::string(fn) + ": out of host memory";
    return DDP_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    last_error() = std::string(fn) + ": internal error: " + e.what();
    return DDP_ERR_INTERNAL;
  } catch (...) {
    last_error() = std::string(fn) + ": internal error (unknown exception)";
    return DDP_ERR_INTERNAL;
  }
}

template <class T>
void need(const T* p, const char* what) {
  if (!p) fail(DDP_ERR_INVALID_ARGUMENT, "%s is NULL", what);
}

// The comm hook running on this thread, and its context (none: both NULL): ddp_comm_allreduce inside
// it uses the hook's stream and deadline, and the context refuses to be entered from it.
struct HookScope {
  const HookCall* call = nullptr;
  const Context* context = nullptr;
};
HookScope& running_hook();

// The context behind a handle (DDP_ERR_INVALID_ARGUMENT for NULL; DDP_ERR_INVALID_STATE from inside its
// own comm hook, where the thread that waits for the bucket may hold the context's lock).
Context& context_of(ddp_t d);
void refuse_reentry(ddp_t d);
Comm& comm_of(ddp_comm_t c);
ddp_comm_t wrap(std::unique_ptr<Comm> c);
// A status's text from its int (what a hook returns may be any int).
const char* status_name(int status);
// The bound of creation calls without a timeout argument, and of ddp_comm_allreduce outside a hook.
int64_t default_init_timeout_ms();

}  // namespace shell
}  // namespace ddp
