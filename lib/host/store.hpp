// The rendezvous: how ranks that share no MPI find each other. A key-value store that every rank
// reaches (a TCP server on rank 0, or a directory on a shared file system), and the parsing of the
// init methods that name one: "env://" (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as torchrun
// sets them), "tcp://HOST:PORT" and "file:///PATH". Communicators made this way (Gloo, NCCL ids)
// exchange their addresses through it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/common.hpp"

namespace ddp {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& value, Deadline dl) = 0;
  // Waits until `key` is set, then returns its value. Throws DDP_ERR_TIMEOUT at the deadline,
  // saying that `who` never set it.
  virtual std::vector<char> get(const std::string& key, Deadline dl, const std::string& who) = 0;
  // Sets `key` to `value` unless it is set already, atomically among the ranks: true when this call
  // set it; false, with the value it holds in *held, when it was set before.
  virtual bool claim(const std::string& key, const std::vector<char>& value, std::vector<char>* held, Deadline dl) = 0;
  // The value of `key` if it is set now, without waiting.
  virtual bool try_get(const std::string& key, std::vector<char>* out, Deadline dl) = 0;
  // Forgets a key (a file store's files would otherwise outlive the job).
  virtual void erase(const std::string& key) {}
};

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

// The TCP store's server alone, for a process that hosts a job's store for its whole life
// (tools/ddp_store; the ranks then set DDP_STORE_EXTERNAL=1): listens on `port` (0: any), calls
// `listening` with the port bound, and serves until `stop` (polled every 100 ms) returns true.
void serve_store(int port, const std::function<void(int)>& listening, const std::function<bool()>& stop);

// The port the TCP store of env:// listens on: DDP_STORE_PORT if set, else MASTER_PORT + 1 (MASTER_PORT
// itself belongs to torchrun's or torch.distributed's own store in the same job).
int env_store_port(int master_port);

}  // namespace ddp
