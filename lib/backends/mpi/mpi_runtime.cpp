// MPI's initialization and finalization in this process: libddp initializes MPI only when the
// program has not, and then finalizes it at exit, unless a request is still posted or a stream worker
// was written off inside MPI (see g_gave_up).
#include "backends/mpi/mpi_runtime.hpp"

#include <atomic>
#include <cstdlib>

#include "host/host_device.hpp"

namespace ddp {
namespace mpi {

namespace {

std::once_flag g_init_once, g_hook_once;

// Set once a request of this process was left posted at its deadline (a collective or a duplication
// that timed out): a peer may be dead. With that, or with a stream worker written off inside a
// collective (host::any_written_off), MPI_Finalize is unsafe (it unloads the transports under a
// blocked worker) and may wait forever (for the dead peer): it is skipped at exit. An abort with
// nothing left inside MPI (a mismatch, the unused-grad error, a failed hook) finalizes as usual.
std::atomic<bool> g_gave_up{false};

void stop_responders() {
  Responders& r = responders();
  std::lock_guard<std::mutex> lock(r.mu);
  for (std::function<void()>* stop : r.stops) (*stop)();
  r.stops.clear();
}

// Attributes of MPI_COMM_SELF are deleted first thing in MPI_Finalize, while MPI still works.
int on_finalize(MPI_Comm, int, void*, void*) {
  stop_responders();
  return MPI_SUCCESS;
}

void hook_finalize() {
  std::call_once(g_hook_once, [] {
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, on_finalize, &key, nullptr) == MPI_SUCCESS)
      MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
  });
}

// The library's own MPI_Finalize, when it initialized MPI: skipped after a collective gave up.
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  stop_responders();
  if (!g_gave_up.load() && !host::any_written_off()) MPI_Finalize();
}

}  // namespace

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return format("MPI error %d", code);
  return std::string(text, static_cast<size_t>(len));
}

void gave_up() { g_gave_up.store(true); }

Responders& responders() {
  static auto* r = new Responders();  // never destroyed: used at exit
  return *r;
}

void ensure_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    std::call_once(g_init_once, [] {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS)
        std::atexit(finalize_at_exit);
    });
    MPI_Initialized(&initialized);
    if (!initialized) fail(DDP_ERR_MPI, "MPI_Init_thread failed");
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) fail(DDP_ERR_INVALID_STATE, "MPI has already been finalized");
  hook_finalize();
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE)
    fail(DDP_ERR_UNSUPPORTED,
         "MPI was initialized with thread level %d; libddp needs MPI_THREAD_MULTIPLE (%d), since its "
         "bucket streams call MPI from worker threads: use MPI_Init_thread",
         level, MPI_THREAD_MULTIPLE);
}

}  // namespace mpi
}  // namespace ddp
