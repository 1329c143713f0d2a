// The rendezvous: how ranks that share no MPI find each other. The init methods that name a store
// (host/store.hpp): "env://" (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as torchrun sets them),
// "tcp://HOST:PORT" and "file:///PATH"; then every rank's arrival through it. Communicators made this
// way (Gloo, NCCL ids) exchange their addresses through the store.
#pragma once

#include <memory>
#include <string>

#include "host/store.hpp"

namespace ddp {

struct Rendezvous {
  std::shared_ptr<Store> store;
  int rank = 0, size = 1;
  // The address of this rank as the others reach it ("": let the transport pick the host's name).
  std::string host;
  // What was used, for messages: "env:// (127.0.0.1:29501)".
  std::string describe;
};

// Opens the store named by `init_method` (NULL or "" means "env://"). `rank` and `size` < 0 are read
// from RANK and WORLD_SIZE. Rank 0 of a TCP store listens; the others connect, trying until `dl`.
// Throws DDP_ERR_INVALID_ARGUMENT for a malformed method, a port outside 1..65535 or a missing
// variable, saying how to fix it. Then every rank arrives (join_rendezvous) as `job` (default:
// knobs::job_id(), the launcher's DDP_JOB_ID or torchrun's TORCHELASTIC_RUN_ID).
Rendezvous open_rendezvous(const char* init_method, int rank, int size, Deadline dl);
Rendezvous open_rendezvous(const char* init_method, int rank, int size, Deadline dl, const std::string& job);

// The store alone, for a process that joins a running elastic job: no arrival (the job's world met
// long ago), and a TCP store is never served here (it lives in rank 0's process or in tools/ddp_store).
Rendezvous open_joining_store(const char* init_method, Deadline dl);

// The arrival: rank 0 publishes its job id and WORLD_SIZE, every other rank checks its own against
// them and claims its rank number; rank 0 waits until every rank of the world has arrived (a progress
// line through the log every DDP_INIT_PROGRESS_MS meanwhile) and tells them all to go on. Refused with
// DDP_ERR_MISMATCH, naming the ranks, hosts and processes: a rank of another job (that rank only; rank 0
// warns), a WORLD_SIZE that differs from rank 0's, a rank beyond the world, a rank number claimed
// twice (those and every rank of the job). DDP_ERR_TIMEOUT at `dl`, naming the ranks that never came.
void join_rendezvous(const Rendezvous& rv, const std::string& job, Deadline dl);
// Once every rank has passed its arrival (after a barrier over the communicator made): rank 0 erases
// the arrival's keys. Once per rendezvous.
void settle_rendezvous(const Rendezvous& rv);

// The port the TCP store of env:// listens on: DDP_STORE_PORT if set, else MASTER_PORT + 1 (MASTER_PORT
// itself belongs to torchrun's or torch.distributed's own store in the same job).
int env_store_port(int master_port);

}  // namespace ddp
