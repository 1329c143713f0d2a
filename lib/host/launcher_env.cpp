#include "host/launcher_env.hpp"

#include <unistd.h>

#include "core/common.hpp"
#include "core/launcher.hpp"
#include "core/knobs.hpp"
#include "core/log.hpp"
#include "host/hostlist.hpp"

extern char** environ;

namespace ddp {

namespace {

enum Field { kRank, kSize, kLocalRank, kLocalSize, kNumFields };
const char* const kFieldNames[kNumFields] = {"rank", "world size", "local rank", "local size"};

struct Source {
  const char* launcher;
  const char* vars[kNumFields];  // nullptr where the launcher sets no such variable
};

// In order of precedence: the launcher nearest the process first (torchrun is usually started by one
// of the others, the MPI launchers often inside a Slurm allocation).
constexpr int kNumSources = 5, kTorchrun = 0, kOpenMpi = 1, kPmi = 2, kPmix = 3, kSlurm = 4;
const Source kSources[kNumSources] = {
    {"torchrun", {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}},
    {"Open MPI",
     {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}},
    {"MPICH/Hydra (PMI)", {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}},
    {"PMIx", {"PMIX_RANK", nullptr, nullptr, nullptr}},
    {"Slurm", {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr}},
};

// A variable's value; nullptr when it is unset or empty (an empty value is taken as unset, as a
// shell's `export RANK=` leaves it).
const std::string* get(const EnvMap& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}
bool has(const EnvMap& env, const char* name) { return get(env, name) != nullptr; }

// The sources that describe this process (the launcher that started it, and those of the same
// layer), and the variables of the outer ones, left out.
struct Layer {
  bool used[kNumSources] = {true, true, true, true, true};
  std::string outer;
};

// A task of a Slurm job step (srun) has SLURM_STEP_ID; a batch script has SLURM_PROCID=0 and the
// job's SLURM_NTASKS without one.
bool slurm_step(const EnvMap& env) { return has(env, "SLURM_STEP_ID") || has(env, "SLURM_STEPID"); }

Layer choose_layer(const EnvMap& env) {
  Layer l;
  std::string why;
  if (has(env, "RANK") && (has(env, "GROUP_RANK") || has(env, "TORCHELASTIC_RUN_ID"))) {
    why = std::string(has(env, "GROUP_RANK") ? "GROUP_RANK" : "TORCHELASTIC_RUN_ID") +
          " says torchrun started this process: an outer launcher's";
    for (int s = 0; s < kNumSources; ++s) l.used[s] = s == kTorchrun;
  } else if (has(env, "OMPI_COMM_WORLD_RANK") || has(env, "MPI_LOCALRANKID")) {
    why = std::string(has(env, "OMPI_COMM_WORLD_RANK") ? "OMPI_COMM_WORLD_RANK says mpirun"
                                                       : "MPI_LOCALRANKID says "
                                                         "mpiexec") +
          " started this process: an outer launcher's";
    l.used[kSlurm] = false;
  } else if (!slurm_step(env)) {
    why = "no SLURM_STEP_ID: Slurm's batch script or salloc shell, not a task of srun";
    l.used[kSlurm] = false;
  }
  std::string vars;
  for (int s = 0; s < kNumSources; ++s)
    for (int f = 0; f < kNumFields && !l.used[s]; ++f)
      if (kSources[s].vars[f] && has(env, kSources[s].vars[f]))
        vars += (vars.empty() ? "" : " ") + std::string(kSources[s].vars[f]) + "=" + *get(env, kSources[s].vars[f]);
  if (!vars.empty()) l.outer = vars + " (" + why + ")";
  return l;
}

int parse_count(const std::string& text, const char* var) {
  int64_t v = 0;
  if (!knobs::parse_integer(text.c_str(), 0, int64_t(1) << 30, &v))
    fail(DDP_ERR_INVALID_ARGUMENT, "init method auto: %s='%s' is not an integer in 0..%d", var, text.c_str(), 1 << 30);
  return static_cast<int>(v);
}

struct Value {
  int v = -1;
  const char* var = nullptr;  // the variable that gave it (nullptr: none did)
  int source = -1;
};

// Each field from the first used source that sets it; every other used source that sets it must agree.
void read_values(const EnvMap& env, const Layer& l, Value out[kNumFields]) {
  for (int f = 0; f < kNumFields; ++f)
    for (int s = 0; s < kNumSources; ++s) {
      const char* var = kSources[s].vars[f];
      if (!l.used[s] || !var || !has(env, var)) continue;
      const int v = parse_count(*get(env, var), var);
      if (!out[f].var) {
        out[f] = Value{v, var, s};
      } else if (out[f].v != v) {
        fail(DDP_ERR_INVALID_ARGUMENT,
             "init method auto: the launchers' variables disagree on the %s: %s=%s (%s) but %s=%s (%s); unset the "
             "one that does not belong to this job (exported by hand, or left from another job)",
             kFieldNames[f], out[f].var, get(env, out[f].var)->c_str(), kSources[out[f].source].launcher, var,
             get(env, var)->c_str(), kSources[s].launcher);
      }
    }
}

[[noreturn]] void no_rank(const EnvMap& env) {
  std::string hint;
  if (has(env, "SLURM_JOB_ID") && !slurm_step(env))
    hint = "; SLURM_JOB_ID=" + *get(env, "SLURM_JOB_ID") +
           " is set but SLURM_STEP_ID is not: this is a Slurm batch script or salloc shell, not a task of srun "
           "(start the ranks with srun)";
  fail(DDP_ERR_INVALID_ARGUMENT,
       "init method auto: no launcher's variables give this process a rank: start it with torchrun, srun (Slurm), "
       "mpirun (Open MPI) or mpiexec (MPICH), or set RANK and WORLD_SIZE (and MASTER_ADDR and MASTER_PORT) as "
       "torchrun does%s",
       hint.c_str());
}

void check_values(const EnvMap& env, const Value v[kNumFields]) {
  if (!v[kRank].var) no_rank(env);
  if (!v[kSize].var)
    fail(DDP_ERR_INVALID_ARGUMENT,
         "init method auto: %s=%d gives the rank, but no launcher's variable gives the world size: set WORLD_SIZE",
         v[kRank].var, v[kRank].v);
  if (v[kSize].v < 1)
    fail(DDP_ERR_INVALID_ARGUMENT, "init method auto: %s=0: a world has at least one rank", v[kSize].var);
  if (v[kRank].v >= v[kSize].v)
    fail(DDP_ERR_INVALID_ARGUMENT, "init method auto: %s=%d is not below %s=%d (ranks are 0..size-1)", v[kRank].var,
         v[kRank].v, v[kSize].var, v[kSize].v);
  if (v[kLocalSize].var && (v[kLocalSize].v < 1 || v[kLocalSize].v > v[kSize].v))
    fail(DDP_ERR_INVALID_ARGUMENT, "init method auto: %s=%d is not within 1..%s=%d", v[kLocalSize].var, v[kLocalSize].v,
         v[kSize].var, v[kSize].v);
  if (v[kLocalRank].var && v[kLocalRank].v >= (v[kLocalSize].var ? v[kLocalSize].v : v[kSize].v))
    fail(DDP_ERR_INVALID_ARGUMENT, "init method auto: %s=%d is not below %s=%d", v[kLocalRank].var, v[kLocalRank].v,
         v[kLocalSize].var ? v[kLocalSize].var : v[kSize].var, v[kLocalSize].var ? v[kLocalSize].v : v[kSize].v);
}

// Why the job is known to run on one host ("" when it is not known).
std::string one_host(const EnvMap& env, const Layer& l, const Value v[kNumFields]) {
  if (v[kSize].v == 1) return format("%s=1", v[kSize].var);
  if (v[kLocalSize].var && v[kLocalSize].v == v[kSize].v)
    return format("%s=%d, the world size", v[kLocalSize].var, v[kLocalSize].v);
  if (l.used[kSlurm] && has(env, "SLURM_PROCID"))
    for (const char* nodes : {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"})
      if (has(env, nodes)) return *get(env, nodes) == "1" ? format("%s=1", nodes) : "";
  return "";
}

// Slurm's rank variables are this process's (srun started it).
bool slurm_started(const EnvMap& env, const Layer& l) { return l.used[kSlurm] && has(env, "SLURM_PROCID"); }

void find_address(const EnvMap& env, const Layer& l, LauncherEnv* f) {
  if (const std::string* a = get(env, "MASTER_ADDR")) {
    f->addr = *a, f->addr_from = "MASTER_ADDR";
  } else if (!f->one_host.empty()) {
    f->addr = "127.0.0.1", f->addr_from = "the loopback: one host (" + f->one_host + ")";
  } else {
    for (const char* list : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"})
      if (slurm_started(env, l) && has(env, list)) {
        f->addr = first_host(*get(env, list), list), f->addr_from = std::string("the first host of ") + list;
        return;
      }
    fail(DDP_ERR_INVALID_ARGUMENT,
         "init method auto: %s gives no rendezvous address, and nothing says the %d ranks share one host: set "
         "MASTER_ADDR to rank 0's host (and MASTER_PORT), or use tcp://HOST:PORT",
         f->launcher.c_str(), f->size);
  }
}

uint64_t parse_id(const std::string& text, const char* var) {
  int64_t v = 0;
  if (!knobs::parse_integer(text.c_str(), 0, int64_t(1) << 62, &v))
    fail(DDP_ERR_INVALID_ARGUMENT, "init method auto: %s='%s' is not a non-negative integer", var, text.c_str());
  return static_cast<uint64_t>(v);
}

void find_port(const EnvMap& env, const Layer& l, LauncherEnv* f) {
  if (const std::string* p = get(env, "DDP_STORE_PORT")) {
    f->port = knobs::port("DDP_STORE_PORT", p->c_str()), f->port_from = "DDP_STORE_PORT";
  } else if (const std::string* mp = get(env, "MASTER_PORT")) {
    const int master = knobs::port("MASTER_PORT", mp->c_str());
    if (master + 1 > 65535)
      fail(DDP_ERR_INVALID_ARGUMENT,
           "MASTER_PORT=%d: libddp's store listens on MASTER_PORT + 1, outside 1..65535; choose a MASTER_PORT of at "
           "most 65534, or name the store's port with DDP_STORE_PORT",
           master);
    f->port = master + 1, f->port_from = "MASTER_PORT + 1";
  } else if (slurm_started(env, l) && has(env, "SLURM_JOB_ID")) {
    const char* step_var = has(env, "SLURM_STEP_ID") ? "SLURM_STEP_ID" : "SLURM_STEPID";  // one is set (choose_layer)
    const std::string &job = *get(env, "SLURM_JOB_ID"), &step = *get(env, step_var);
    f->port = slurm_port(parse_id(job, "SLURM_JOB_ID"), parse_id(step, step_var));
    f->port_from = "SLURM_JOB_ID=" + job + ", " + step_var + "=" + step;
  } else {
    const std::pair<int, const char*> ids[] = {
        {kPmix, "PMIX_NAMESPACE"}, {kOpenMpi, "OMPI_MCA_ess_base_jobid"}, {kPmi, "PMI_JOBID"}};
    for (const auto& id : ids)
      if (l.used[id.first] && has(env, kSources[id.first].vars[kRank]) && has(env, id.second)) {
        f->port = job_port(*get(env, id.second)), f->port_from = std::string(id.second) + "=" + *get(env, id.second);
        return;
      }
    fail(DDP_ERR_INVALID_ARGUMENT,
         "init method auto: %s gives no port and no job id to derive one from: set MASTER_PORT (libddp's store "
         "listens on MASTER_PORT + 1; best below 32768) or DDP_STORE_PORT",
         f->launcher.c_str());
  }
}

}  // namespace

LauncherEnv detect_ranks(const EnvMap& env) {
  const Layer l = choose_layer(env);
  Value v[kNumFields];
  read_values(env, l, v);
  check_values(env, v);
  LauncherEnv f;
  f.launcher = kSources[v[kRank].source].launcher;
  f.rank = v[kRank].v, f.rank_var = v[kRank].var;
  f.size = v[kSize].v, f.size_var = v[kSize].var;
  f.one_host = one_host(env, l, v);
  if (v[kLocalRank].var)
    f.local_rank = v[kLocalRank].v, f.local_rank_var = v[kLocalRank].var;
  else if (!f.one_host.empty())
    f.local_rank = f.rank;  // one host: the local rank is the rank
  f.outer = l.outer;
  return f;
}

LauncherEnv detect_launcher(const EnvMap& env) {
  LauncherEnv f = detect_ranks(env);
  const Layer l = choose_layer(env);
  find_address(env, l, &f);
  find_port(env, l, &f);
  return f;
}

std::string describe_launcher(const LauncherEnv& f) {
  const std::string local = f.local_rank < 0
                                ? "local rank unknown"
                                : format("local rank %d (%s)", f.local_rank,
                                         f.local_rank_var.empty() ? "the rank, on one host" : f.local_rank_var.c_str());
  return format(
      "init method auto: launcher %s; rank %d (%s) of %d (%s), %s; rendezvous at %s:%d (address: %s; port: "
      "%s)%s%s",
      f.launcher.c_str(), f.rank, f.rank_var.c_str(), f.size, f.size_var.c_str(), local.c_str(), f.addr.c_str(), f.port,
      f.addr_from.c_str(), f.port_from.c_str(), f.outer.empty() ? "" : "; left out: ", f.outer.c_str());
}

int slurm_port(uint64_t job_id, uint64_t step_id) {
  return kDerivedPortFirst + static_cast<int>(18 * (job_id % 500) + step_id % 18);
}

int job_port(const std::string& identity) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : identity) h = (h ^ c) * 1099511628211ull;
  return kDerivedPortFirst + static_cast<int>(h % (kDerivedPortLast - kDerivedPortFirst + 1));
}

void launcher_ranks(int* rank, int* size, int* local_rank) {
  const LauncherEnv f = detect_ranks(process_environment());
  *rank = f.rank, *size = f.size, *local_rank = f.local_rank;
}

EnvMap process_environment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

std::string resolve_launcher_method(const std::string& method, int* rank, int* size, bool joining,
                                    std::string* describe) {
  describe->clear();
  const EnvMap env = process_environment();
  const bool fallback =
      method == "env://" && !joining && ((*rank < 0 && !has(env, "RANK")) || (*size < 0 && !has(env, "WORLD_SIZE")));
  if (method != "auto" && !fallback) return method;
  const char* said = fallback ? "env:// (without RANK and WORLD_SIZE: as auto)" : "auto";
  LauncherEnv f;
  try {
    f = detect_launcher(env);
  } catch (const Error& e) {
    if (!fallback) throw;
    fail(e.status(), "%s: %s", said, e.what());
  }
  if (!joining) {
    if (*rank >= 0 && *rank != f.rank)
      fail(DDP_ERR_INVALID_ARGUMENT, "init method %s: rank %d was given, but %s says %s=%d (give -1 to take it)", said,
           *rank, f.launcher.c_str(), f.rank_var.c_str(), f.rank);
    if (*size >= 0 && *size != f.size)
      fail(DDP_ERR_INVALID_ARGUMENT, "init method %s: size %d was given, but %s says %s=%d (give -1 to take it)", said,
           *size, f.launcher.c_str(), f.size_var.c_str(), f.size);
    *rank = f.rank, *size = f.size;
  }
  log(DDP_LOG_INFO, "%s%s", fallback ? "env:// without RANK and WORLD_SIZE, as auto: " : "",
      describe_launcher(f).c_str());
  *describe = format("%s (%s, %s:%d)", said, f.launcher.c_str(), f.addr.c_str(), f.port);
  const bool v6 = f.addr.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + f.addr + "]" : f.addr) + ":" + std::to_string(f.port);
}

}  // namespace ddp
