// Every environment variable the library reads, in one table, parsed in one place. Numbers are read
// strictly (the whole value, in range); a bad value is warned about once, through the log, naming the
// variable, what it accepts and the default used instead. The exceptions are the values a failing call
// reports itself, because using a default would hide a mistake that decides where ranks meet or how
// long they wait: DDP_STORE_PORT and DDP_INIT_TIMEOUT_MS answer DDP_ERR_INVALID_ARGUMENT.
// (torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are the env:// rendezvous's arguments,
// read and checked by it: lib/host/rendezvous.cpp. The init method auto reads the launchers' variables, and
// DDP_STORE_PORT by the same rule as store_port, from a map of the environment: lib/host/launcher_env.cpp.)
#pragma once

#include <cstdint>
#include <string>

namespace ddp {
namespace knobs {

// DDP_HOST_PIECE_BYTES: host comms' bytes per collective piece (4096 .. 2^40; default 4 MiB).
size_t host_piece_bytes();
// DDP_INT8_SCATTER_MIN_WORLD: the world size from which the int8 wire reduce-scatters (each rank sums
// one shard of the others' int8 blocks, re-quantizes it and all-gathers the result: about a quarter of
// fp32's bytes at any world size) instead of all-gathering every rank's blocks (one exchange, but
// (world - 1) chunks each way); 1 .. 2^31, default 3 (at world 2 both move the same bytes).
int int8_scatter_min_world();
// DDP_DEBUG_EVERY: with DDP_DEBUG=INFO, a summary every this many iterations (1 .. 2^62; default 100).
uint64_t debug_every();
// DDP_INIT_TIMEOUT_MS: the bound of communicator creation (0 .. 2^62 ms, 0 none; default 300000).
int64_t init_timeout_ms();
// DDP_STORE_PORT: the env:// store's port (1 .. 65535); default `master_port` + 1, refused
// (DDP_ERR_INVALID_ARGUMENT, saying why) when that leaves the range.
int store_port(int master_port);
// A port named by the environment or an init method (`what`: "MASTER_PORT", "the port of
// tcp://HOST:PORT"): the whole value, 1 .. 65535, or DDP_ERR_INVALID_ARGUMENT naming `what` and the range.
int port(const char* what, const char* value);
// DDP_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID: the job a rank belongs to, checked against the
// rendezvous store's ("" when neither is set).
std::string job_id();
// DDP_STORE_EXTERNAL: 1 when the TCP store of env:// and tcp:// is served by its own process
// (tools/ddp_store, started by ddp_launch --elastic) so that it outlives every rank: rank 0 then
// connects to it as the others do instead of serving it (0 .. 1; default 0).
bool store_external();
// DDP_INIT_PROGRESS_MS: while ranks are missing at start-up, a progress line this often (0 .. 2^62 ms,
// 0 none; default 5000).
int64_t init_progress_ms();
// DDP_HOST_SIMD: 0 keeps the host element loops on their portable code even where the CPU has the
// AVX2 / F16C versions (which give the same bits); 1, the default, lets the CPU decide. Read when
// host/host_kernels.cpp makes its choice.
bool host_simd();
// DDP_DEBUG (read by core/log.cpp, which knows its words), DDP_TIMELINE, GLOO_SOCKET_IFNAME: text, or
// "" when unset.
std::string text(const char* name);

// The strict reading of one integer knob, for the functions above and their tests: true with *out
// set when `value` is a whole decimal integer within [lo, hi]; false otherwise (unset: `value` NULL
// or "", *out untouched).
bool parse_integer(const char* value, int64_t lo, int64_t hi, int64_t* out);
// "NAME='value' is not an integer in LO..HI; using DEFAULT": the warning for a bad value.
std::string bad_value_message(const char* name, const char* value, int64_t lo, int64_t hi, int64_t fallback);

// The knobs that change what crosses the wire: ranks that read different values post collectives of
// different sizes (DDP_HOST_PIECE_BYTES cuts every host collective into pieces, and the ring's
// exchanges follow them; DDP_INT8_SCATTER_MIN_WORLD chooses the int8 wire's collectives). ddp_create agrees on each
// (core/agreement.cpp) and refuses a difference with DDP_ERR_MISMATCH naming the knob. The other knobs change only what
// one rank prints, how long it waits or where it listens (the rendezvous checks the job's identity itself): none is on
// this list.
struct WireKnob {
  const char* name;
  int64_t value;  // as this rank reads it (its default when unset)
};
constexpr int kNumWireKnobs = 2;
void wire_knobs(WireKnob out[kNumWireKnobs]);

}  // namespace knobs
}  // namespace ddp
