// A write to a socket whose peer died raises SIGPIPE, whose default action ends the process without
// a word: a survivor of a dead rank would vanish instead of reporting it. libddp's own sockets send
// with MSG_NOSIGNAL (tcp.cpp); Gloo writes with writev, which has no such flag. While a SigpipeBlock
// lives, SIGPIPE is blocked in the calling thread, so such a write fails with EPIPE (which Gloo
// reports as a failed pair); a SIGPIPE raised meanwhile is taken off before the thread's mask is put
// back. Blocks nest (only the outermost touches the mask); a thread that blocked SIGPIPE itself is
// left as it is. Threads started meanwhile (Gloo's event loop) inherit the blocked mask for good.
// The process's signal dispositions are never changed.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <ctime>

namespace ddp {
namespace host {

class SigpipeBlock {
 public:
  SigpipeBlock() {
    if (depth()++ > 0) return;
    const sigset_t pipe = only_sigpipe();
    sigset_t old;
    sigemptyset(&old);
    pthread_sigmask(SIG_BLOCK, &pipe, &old);
    owner_ = sigismember(&old, SIGPIPE) == 0;
  }
  ~SigpipeBlock() {
    --depth();
    if (!owner_) return;
    const sigset_t pipe = only_sigpipe();
    sigset_t pending;
    sigemptyset(&pending);
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec now{0, 0};
      sigtimedwait(&pipe, nullptr, &now);
    }
    pthread_sigmask(SIG_UNBLOCK, &pipe, nullptr);  // only SIGPIPE: other changes made meanwhile stay
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  static sigset_t only_sigpipe() {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    return s;
  }
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
  bool owner_ = false;
};

}  // namespace host
}  // namespace ddp
