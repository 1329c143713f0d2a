// The init method "auto": a process learns its rank, the world size, its local rank and where the
// rendezvous listens from the variables its launcher set: torchrun's, Slurm's (srun), Open MPI's and
// PMIx's (mpirun), MPICH's Hydra (mpiexec). The detection is a pure function of an environment map,
// so that every case is tested without touching the process's environment; resolve_launcher_method
// applies it to the real one for the rendezvous (host/store.cpp).
//
// The rules (documented for users in include/ddp.h and docs/api.md, "The init method auto"):
// - Sources, in order of precedence: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), Open
//   MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE), MPICH's Hydra and other PMI-1 servers
//   (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), PMIx (PMIX_RANK), Slurm (SLURM_PROCID,
//   SLURM_NTASKS, SLURM_LOCALID). Each value comes from the first source that has it; every other
//   source that has it must agree, or the call is refused naming both variables and their values.
// - Launchers nest (srun torchrun, mpirun inside an sbatch script): the variables of the launcher
//   that started this process are used, and an outer launcher's are left out, not compared. torchrun
//   is known by GROUP_RANK or TORCHELASTIC_RUN_ID (every other source is then outer); mpirun by
//   OMPI_COMM_WORLD_RANK and Hydra by MPI_LOCALRANKID (Slurm's are then outer: they describe the
//   batch script or mpirun's daemons). PMI_RANK and PMIX_RANK alone may come from srun's own PMI
//   plugins, and are compared with Slurm's.
// - Address: MASTER_ADDR; else the loopback when the job is known to run on one host (one rank; a
//   local size equal to the world size; SLURM_STEP_NUM_NODES or SLURM_NNODES of 1); else the first
//   host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST); else refused, naming MASTER_ADDR.
// - Port (the store's): DDP_STORE_PORT; else MASTER_PORT + 1, as env://; else one derived from
//   SLURM_JOB_ID and SLURM_STEP_ID, or from the MPI launcher's job id (PMIX_NAMESPACE,
//   OMPI_MCA_ess_base_jobid, PMI_JOBID), in kDerivedPortFirst..kDerivedPortLast; else refused.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace ddp {

using EnvMap = std::map<std::string, std::string>;

// Derived ports lie here: below the kernel's range for outgoing connections (32768 and up by
// default), where no connection takes them, and below torchrun's default MASTER_PORT 29500.
constexpr int kDerivedPortFirst = 20000;
constexpr int kDerivedPortLast = 28999;

struct LauncherEnv {
  std::string launcher;                            // "torchrun", "Open MPI", "MPICH/Hydra (PMI)", "PMIx" or "Slurm"
  int rank = -1, size = 0;                         // from the launcher's variables
  int local_rank = -1;                             // -1 when no variable gives it and the job may span hosts
  std::string rank_var, size_var, local_rank_var;  // the variables that gave them ("" for none)
  std::string one_host;                            // why the job is known to run on one host ("" when it is not known)
  std::string addr, addr_from;                     // where rank 0's store listens, and what said so
  int port = 0;
  std::string port_from;
  std::string outer;  // the outer launchers' variables left out ("" when none)
};

// Rank, world size and local rank alone (ddp_launcher_ranks): DDP_ERR_INVALID_ARGUMENT when no
// launcher's variables give a rank and a world size, when a value is malformed or out of range, or
// when two sources disagree.
LauncherEnv detect_ranks(const EnvMap& env);
// All of it, address and port included (the init method "auto").
LauncherEnv detect_launcher(const EnvMap& env);
// The one line of the log that says what was found.
std::string describe_launcher(const LauncherEnv& found);

// The derived ports: kDerivedPortFirst + 18 * (job mod 500) + (step mod 18) for Slurm, so that jobs
// whose ids differ by less than 500 never share a port while their steps are below 18; a hash of the
// job's identity into the same range for the MPI launchers.
int slurm_port(uint64_t job_id, uint64_t step_id);
int job_port(const std::string& identity);

// The process's environment as a map.
EnvMap process_environment();

// The rendezvous named by `method` as store.cpp opens it: "auto", and "env://" when RANK or
// WORLD_SIZE is missing while the rank or size is left to it (< 0; not for a joining process, which
// needs neither), become "tcp://ADDR:PORT" with *rank and *size taken from the launcher (a given
// rank or size >= 0 must agree: DDP_ERR_INVALID_ARGUMENT otherwise), and *describe says what was
// found ("auto (Slurm: 127.0.0.1:20054)"); what was found goes to the log (DDP_LOG_INFO). Any other
// method comes back unchanged, with *describe "".
std::string resolve_launcher_method(const std::string& method, int* rank, int* size, bool joining,
                                    std::string* describe);

}  // namespace ddp
