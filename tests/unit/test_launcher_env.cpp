// The init method "auto" (host/launcher_env.hpp): what each launcher's variables give alone, every
// pair of launchers that agree, every contradiction between two of them, launchers nested in others,
// the address and port rules, what is missing with its message, Slurm's hostlists and the derived
// ports. The detection is a function of an environment map: nothing here sets the process's
// environment but the last cases, which restore it.
#include <doctest.h>

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "ddp.h"
#include "core/common.hpp"
#include "host/hostlist.hpp"
#include "host/launcher_env.hpp"

using ddp::EnvMap;
using ddp::LauncherEnv;

namespace {

// The message of the refusal (DDP_ERR_INVALID_ARGUMENT), or "" when `f` did not throw.
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const ddp::Error& e) {
    CHECK(e.status() == DDP_ERR_INVALID_ARGUMENT);
    return e.what();
  }
  return "";
}
std::string refused(const EnvMap& env) {
  return refusal([&] { ddp::detect_launcher(env); });
}
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Each launcher's variables, as it sets them for rank 1 of 4, local rank 1 of 2.
struct Launcher {
  const char* name;
  const char* vars[4];  // rank, size, local rank, local size (nullptr: none)
};
const Launcher kLaunchers[] = {
    {"torchrun", {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}},
    {"Open MPI",
     {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}},
    {"MPICH/Hydra (PMI)", {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}},
    {"PMIx", {"PMIX_RANK", nullptr, nullptr, nullptr}},
    {"Slurm", {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr}},
};
const int kValues[4] = {1, 4, 1, 2};
constexpr int kNumLaunchers = 5, kOpenMpi = 1, kPmi = 2, kSlurm = 4;

void add_launcher(EnvMap* env, int l) {
  if (l == kSlurm) (*env)["SLURM_STEP_ID"] = "0";  // a task of srun (a batch script has none)
  for (int f = 0; f < 4; ++f)
    if (kLaunchers[l].vars[f]) (*env)[kLaunchers[l].vars[f]] = std::to_string(kValues[f]);
}

// Where the rendezvous is, so that only the ranks are under test.
EnvMap with_address() { return EnvMap{{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}; }

// Open MPI's and Hydra's full sets mark them as the launcher that started the process (mpirun's
// OMPI_COMM_WORLD_RANK, Hydra's MPI_LOCALRANKID): Slurm's variables then belong to an outer layer.
bool compared(int a, int b) {
  const int other = a == kSlurm ? b : b == kSlurm ? a : -1;
  return other != kOpenMpi && other != kPmi;
}

}  // namespace

TEST_CASE("auto: each launcher's variables, set alone, give the rank, size and local rank") {
  for (int l = 0; l < kNumLaunchers; ++l) {
    EnvMap env = with_address();
    add_launcher(&env, l);
    if (l == 3) env["WORLD_SIZE"] = "4";  // PMIx sets no size variable
    CAPTURE(kLaunchers[l].name);
    const LauncherEnv f = ddp::detect_launcher(env);
    CHECK(f.launcher == kLaunchers[l].name);
    CHECK(f.rank == 1);
    CHECK(f.size == 4);
    CHECK(f.local_rank == (kLaunchers[l].vars[2] ? 1 : -1));
    CHECK(f.rank_var == kLaunchers[l].vars[0]);
    CHECK(f.addr == "10.0.0.1");
    CHECK(f.port == 29501);
    CHECK(f.outer.empty());
  }
}

TEST_CASE("auto: every variable set alone says what is missing") {
  for (int l = 0; l < kNumLaunchers; ++l)
    for (int f = 0; f < 4; ++f) {
      const char* var = kLaunchers[l].vars[f];
      if (!var) continue;
      CAPTURE(var);
      EnvMap env{{var, "1"}};
      if (l == kSlurm) env["SLURM_STEP_ID"] = "0";  // a task of srun
      const std::string m = refused(env);
      if (f == 0) {
        CHECK(has(m, std::string(var) + "=1 gives the rank, but no launcher's variable gives the world size"));
        CHECK(has(m, "set WORLD_SIZE"));
      } else {
        CHECK(has(m, "no launcher's variables give this process a rank"));
        for (const char* how : {"torchrun", "srun", "mpirun", "mpiexec", "RANK and WORLD_SIZE"}) CHECK(has(m, how));
      }
    }
  for (const char* var : {"MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NODELIST", "PMIX_NAMESPACE", "GROUP_RANK"}) {
    CAPTURE(var);
    CHECK(has(refused(EnvMap{{var, "1"}}), "no launcher's variables give this process a rank"));
  }
}

TEST_CASE("auto: every pair of launchers that agree; the first in precedence names the launcher") {
  for (int a = 0; a < kNumLaunchers; ++a)
    for (int b = a + 1; b < kNumLaunchers; ++b) {
      EnvMap env = with_address();
      add_launcher(&env, a);
      add_launcher(&env, b);
      CAPTURE(kLaunchers[a].name);
      CAPTURE(kLaunchers[b].name);
      const LauncherEnv f = ddp::detect_launcher(env);
      CHECK(f.launcher == kLaunchers[a].name);
      CHECK(f.rank == 1);
      CHECK(f.size == 4);
      CHECK(f.local_rank == 1);
      CHECK(f.outer.empty() == compared(a, b));
    }
}

TEST_CASE("auto: every contradiction between two launchers is refused, naming both variables and values") {
  int refusals = 0;
  for (int a = 0; a < kNumLaunchers; ++a)
    for (int b = a + 1; b < kNumLaunchers; ++b)
      for (int f = 0; f < 4; ++f) {
        const char *va = kLaunchers[a].vars[f], *vb = kLaunchers[b].vars[f];
        if (!va || !vb) continue;
        EnvMap env = with_address();
        add_launcher(&env, a);
        add_launcher(&env, b);
        env[vb] = f == 1 ? "3" : "0";  // a world of 3, a rank or local rank of 0, a local size of 0
        CAPTURE(va);
        CAPTURE(vb);
        const std::string m = refused(env);
        if (!compared(a, b)) {
          CHECK(m.empty());  // an outer launcher's variables: left out
          continue;
        }
        ++refusals;
        CHECK(has(m, "the launchers' variables disagree"));
        CHECK(has(m, std::string(va) + "=" + std::to_string(kValues[f]) + " (" + kLaunchers[a].name + ")"));
        CHECK(has(m, std::string(vb) + "=" + env[vb] + " (" + kLaunchers[b].name + ")"));
      }
  CHECK(refusals == 19);
  // The issue's own example, and srun --mpi=pmi2 (PMI_RANK without Hydra's MPI_LOCALRANKID) against Slurm.
  CHECK(has(
      refused(EnvMap{
          {"RANK", "1"}, {"WORLD_SIZE", "4"}, {"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_ID", "0"}}),
      "RANK=1 (torchrun) but SLURM_PROCID=2 (Slurm)"));
  CHECK(has(
      refused(EnvMap{
          {"PMI_RANK", "1"}, {"PMI_SIZE", "4"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_ID", "0"}}),
      "PMI_RANK=1 (MPICH/Hydra (PMI)) but SLURM_PROCID=3 (Slurm)"));
  CHECK(has(refused(EnvMap{{"PMIX_RANK", "1"}, {"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEPID", "0"}}),
            "PMIX_RANK=1 (PMIx) but SLURM_PROCID=2 (Slurm)"));
}

TEST_CASE("auto: nested launchers: the innermost one's variables, the outer ones' left out and said") {
  SUBCASE("srun torchrun: GROUP_RANK marks torchrun's workers; Slurm's describe its agents") {
    const LauncherEnv f = ddp::detect_launcher(EnvMap{{"RANK", "5"},
                                                      {"WORLD_SIZE", "8"},
                                                      {"LOCAL_RANK", "1"},
                                                      {"GROUP_RANK", "1"},
                                                      {"MASTER_ADDR", "n1"},
                                                      {"MASTER_PORT", "29500"},
                                                      {"SLURM_PROCID", "1"},
                                                      {"SLURM_STEP_ID", "0"},
                                                      {"SLURM_NTASKS", "2"},
                                                      {"SLURM_LOCALID", "0"}});
    CHECK(f.launcher == "torchrun");
    CHECK(f.rank == 5);
    CHECK(f.local_rank == 1);
    CHECK(has(f.outer, "SLURM_PROCID=1"));
    CHECK(has(f.outer, "GROUP_RANK"));
  }
  SUBCASE("mpirun torchrun: TORCHELASTIC_RUN_ID marks them too") {
    const LauncherEnv f = ddp::detect_launcher(EnvMap{{"RANK", "3"},
                                                      {"WORLD_SIZE", "4"},
                                                      {"TORCHELASTIC_RUN_ID", "x"},
                                                      {"MASTER_ADDR", "n1"},
                                                      {"MASTER_PORT", "29500"},
                                                      {"OMPI_COMM_WORLD_RANK", "0"},
                                                      {"OMPI_COMM_WORLD_SIZE", "1"}});
    CHECK(f.rank == 3);
    CHECK(has(f.outer, "OMPI_COMM_WORLD_RANK=0"));
  }
  SUBCASE("mpirun in a Slurm batch script: Open MPI's variables; Slurm's port and nodes are not used") {
    const LauncherEnv f = ddp::detect_launcher(EnvMap{{"OMPI_COMM_WORLD_RANK", "2"},
                                                      {"OMPI_COMM_WORLD_SIZE", "3"},
                                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                                                      {"OMPI_MCA_ess_base_jobid", "620822529"},
                                                      {"SLURM_PROCID", "0"},
                                                      {"SLURM_NTASKS", "1"},
                                                      {"SLURM_JOB_ID", "77"},
                                                      {"SLURM_NNODES", "2"},
                                                      {"SLURM_JOB_NODELIST", "n[1-2]"}});
    CHECK(f.launcher == "Open MPI");
    CHECK(f.rank == 2);
    CHECK(f.addr == "127.0.0.1");
    CHECK(f.port == ddp::job_port("620822529"));
    CHECK(has(f.outer, "SLURM_PROCID=0 SLURM_NTASKS=1"));
  }
  SUBCASE("ranks started by hand in a Slurm batch script: the batch script's SLURM_PROCID is left out") {
    const LauncherEnv f = ddp::detect_launcher(EnvMap{{"RANK", "1"},
                                                      {"WORLD_SIZE", "2"},
                                                      {"MASTER_ADDR", "h"},
                                                      {"MASTER_PORT", "29500"},
                                                      {"SLURM_PROCID", "0"},
                                                      {"SLURM_NTASKS", "1"},
                                                      {"SLURM_JOB_ID", "8"}});
    CHECK(f.rank == 1);
    CHECK(has(f.outer, "SLURM_PROCID=0 SLURM_NTASKS=1 (no SLURM_STEP_ID: Slurm's batch script"));
  }
  SUBCASE("RANK without torchrun's markers is compared, even under mpirun (a stale export)") {
    CHECK(has(refused(EnvMap{{"RANK", "0"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
              "RANK=0 (torchrun) but OMPI_COMM_WORLD_RANK=1 (Open MPI)"));
  }
}

TEST_CASE("auto: the address: MASTER_ADDR, else the loopback on one host, else Slurm's first node") {
  SUBCASE("MASTER_ADDR decides whatever the launcher") {
    EnvMap env{{"SLURM_PROCID", "0"},         {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"},
               {"SLURM_STEP_NUM_NODES", "1"}, {"MASTER_ADDR", "h7"},  {"SLURM_JOB_ID", "3"}};
    CHECK(ddp::detect_launcher(env).addr == "h7");
  }
  SUBCASE("one host, as each launcher says it") {
    const EnvMap cases[] = {
        {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}},
        {{"PMI_RANK", "0"}, {"PMI_SIZE", "3"}, {"MPI_LOCALNRANKS", "3"}},
        {{"SLURM_PROCID", "0"},
         {"SLURM_STEP_ID", "0"},
         {"SLURM_NTASKS", "3"},
         {"SLURM_STEP_NUM_NODES", "1"},
         {"SLURM_NNODES", "4"}},
        {{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "3"}, {"SLURM_NNODES", "1"}},
        {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
        {{"PMIX_RANK", "0"}, {"WORLD_SIZE", "1"}},
    };
    for (EnvMap env : cases) {
      env["MASTER_PORT"] = "29500";
      const LauncherEnv f = ddp::detect_launcher(env);
      CAPTURE(ddp::describe_launcher(f));
      CHECK(f.addr == "127.0.0.1");
      CHECK(has(f.addr_from, "the loopback: one host"));
      CHECK(f.local_rank == 0);
    }
  }
  SUBCASE("Slurm on several nodes: the first host of the step's nodelist, else the job's") {
    EnvMap env{{"SLURM_PROCID", "5"},
               {"SLURM_NTASKS", "8"},
               {"SLURM_STEP_NUM_NODES", "2"},
               {"SLURM_STEP_NODELIST", "gpu[07-08]"},
               {"SLURM_JOB_NODELIST", "gpu[01-08]"},
               {"SLURM_JOB_ID", "1234"},
               {"SLURM_STEP_ID", "2"},
               {"SLURM_LOCALID", "1"}};
    LauncherEnv f = ddp::detect_launcher(env);
    CHECK(f.addr == "gpu07");
    CHECK(f.addr_from == "the first host of SLURM_STEP_NODELIST");
    CHECK(f.port == ddp::slurm_port(1234, 2));
    CHECK(f.local_rank == 1);
    env.erase("SLURM_STEP_NODELIST");
    CHECK(ddp::detect_launcher(env).addr == "gpu01");
    env["SLURM_JOB_NODELIST"] = "gpu[01-";
    const std::string m = refused(env);
    CHECK(has(m, "SLURM_JOB_NODELIST='gpu[01-' is not a hostlist"));
  }
  SUBCASE("no address and more than one host possible: refused, naming MASTER_ADDR") {
    const EnvMap cases[] = {
        {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
        {{"PMI_RANK", "0"}, {"PMI_SIZE", "4"}},
        {{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NUM_NODES", "2"}},
        {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}},
    };
    for (const EnvMap& env : cases) {
      const std::string m = refused(env);
      CAPTURE(m);
      CHECK(has(m, "gives no rendezvous address"));
      CHECK(has(m, "set MASTER_ADDR"));
    }
  }
}

TEST_CASE("auto: the port: DDP_STORE_PORT, MASTER_PORT + 1, Slurm's job and step, the MPI job id") {
  EnvMap env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}};
  CHECK(has(refused(env), "gives no port and no job id to derive one from: set MASTER_PORT"));
  env["OMPI_MCA_ess_base_jobid"] = "42";
  CHECK(ddp::detect_launcher(env).port == ddp::job_port("42"));
  env["PMIX_RANK"] = "0";
  env["PMIX_NAMESPACE"] = "prterun-vm-1@1";
  CHECK(ddp::detect_launcher(env).port == ddp::job_port("prterun-vm-1@1"));
  env["MASTER_PORT"] = "29500";
  CHECK(ddp::detect_launcher(env).port == 29501);
  env["DDP_STORE_PORT"] = "31000";
  CHECK(ddp::detect_launcher(env).port == 31000);
  CHECK(ddp::detect_launcher(env).port_from == "DDP_STORE_PORT");

  const EnvMap slurm{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "1234"}, {"SLURM_STEP_ID", "3"}};
  const LauncherEnv f = ddp::detect_launcher(slurm);
  CHECK(f.port == ddp::slurm_port(1234, 3));
  CHECK(f.port_from == "SLURM_JOB_ID=1234, SLURM_STEP_ID=3");
  // SLURM_STEPID, the older name, as well.
  CHECK(ddp::detect_launcher(
            EnvMap{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "1234"}, {"SLURM_STEPID", "4"}})
            .port == ddp::slurm_port(1234, 4));

  for (const char* bad : {"0", "65536", "x", "29500 "}) {
    CAPTURE(bad);
    CHECK(has(refused(EnvMap{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", bad}}), "MASTER_PORT='"));
    CHECK(has(refused(EnvMap{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DDP_STORE_PORT", bad}}), "DDP_STORE_PORT='"));
  }
  CHECK(has(refused(EnvMap{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65535"}}), "MASTER_PORT + 1"));
  CHECK(has(
      refused(EnvMap{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "12a"}}),
      "SLURM_JOB_ID='12a' is not a non-negative integer"));
}

TEST_CASE("auto: derived ports lie in 20000..28999, below the kernel's ephemeral range, and do not collide") {
  CHECK(ddp::kDerivedPortLast < 32768);
  CHECK(ddp::slurm_port(0, 0) == 20000);
  CHECK(ddp::slurm_port(499, 17) == 28999);
  CHECK(ddp::slurm_port(500, 18) == 20000);  // wraps
  // 500 consecutive jobs of 18 steps each: 9000 ports, all different, wherever the ids start.
  for (uint64_t first : {uint64_t(0), uint64_t(1234567), uint64_t(4294967000)}) {
    std::set<int> ports;
    for (uint64_t j = first; j < first + 500; ++j)
      for (uint64_t s = 0; s < 18; ++s) ports.insert(ddp::slurm_port(j, s));
    CHECK(ports.size() == 9000);
    CHECK(*ports.begin() == 20000);
    CHECK(*ports.rbegin() == 28999);
  }
  std::set<int> hashed;
  for (int i = 0; i < 1000; ++i) {
    const int p = ddp::job_port("job" + std::to_string(i));
    CHECK(p >= ddp::kDerivedPortFirst);
    CHECK(p <= ddp::kDerivedPortLast);
    hashed.insert(p);
  }
  CHECK(hashed.size() > 900);  // a hash, not a constant
  CHECK(ddp::job_port("620822529") == ddp::job_port("620822529"));
}

TEST_CASE("auto: malformed and out-of-range values are refused, naming the variable") {
  const struct {
    EnvMap env;
    const char* want;
  } cases[] = {
      {{{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK='x' is not an integer in 0..1073741824"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK='-1' is not an integer in 0..1073741824"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0: a world has at least one rank"},
      {{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4 is not below WORLD_SIZE=4"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"}},
       "SLURM_PROCID=2 is not below SLURM_NTASKS=2"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "5"}},
       "LOCAL_WORLD_SIZE=5 is not within 1..WORLD_SIZE=4"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "4"}},
       "SLURM_LOCALID=4 is not below SLURM_NTASKS=4"},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "99999999999"}},
       "OMPI_COMM_WORLD_SIZE='99999999999' is not an integer in 0..1073741824"},
      {{{"SLURM_JOB_ID", "77"}}, "SLURM_JOB_ID=77 is set but SLURM_STEP_ID is not: this is a Slurm batch script"},
      {{{"SLURM_JOB_ID", "77"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}},
       "not a task of srun (start the ranks with srun)"},
  };
  for (const auto& c : cases) {
    const std::string m = refused(c.env);
    CAPTURE(m);
    CHECK(has(m, c.want));
    CHECK(has(m, "init method auto"));
  }
  // An empty value is an unset one (a shell's `export RANK=`).
  CHECK(ddp::detect_launcher(EnvMap{{"RANK", ""},
                                    {"SLURM_PROCID", "1"},
                                    {"SLURM_STEP_ID", "0"},
                                    {"SLURM_NTASKS", "2"},
                                    {"SLURM_NNODES", "1"},
                                    {"SLURM_JOB_ID", "5"}})
            .launcher == "Slurm");
}

TEST_CASE("auto: the log line says the launcher, rank, world, local rank, address and port") {
  const LauncherEnv f = ddp::detect_launcher(EnvMap{{"SLURM_PROCID", "1"},
                                                    {"SLURM_NTASKS", "4"},
                                                    {"SLURM_LOCALID", "1"},
                                                    {"SLURM_STEP_NUM_NODES", "1"},
                                                    {"SLURM_JOB_ID", "12"},
                                                    {"SLURM_STEP_ID", "0"}});
  const std::string line = ddp::describe_launcher(f);
  CAPTURE(line);
  CHECK(line ==
        "init method auto: launcher Slurm; rank 1 (SLURM_PROCID) of 4 (SLURM_NTASKS), local rank 1 "
        "(SLURM_LOCALID); rendezvous at 127.0.0.1:20216 (address: the loopback: one host "
        "(SLURM_STEP_NUM_NODES=1); port: SLURM_JOB_ID=12, SLURM_STEP_ID=0)");
  CHECK(ddp::detect_ranks(EnvMap{{"PMIX_RANK", "2"}, {"WORLD_SIZE", "4"}}).local_rank == -1);
}

TEST_CASE("hostlist: ranges, lists, several brackets in a name, zero padding") {
  using V = std::vector<std::string>;
  const struct {
    const char* list;
    V want;
  } cases[] = {
      {"node[01-04,07],gpu3", V{"node01", "node02", "node03", "node04", "node07", "gpu3"}},
      {"rack[1-2]-n[08-10]", V{"rack1-n08", "rack1-n09", "rack1-n10", "rack2-n08", "rack2-n09", "rack2-n10"}},
      {"n[8-11]", V{"n8", "n9", "n10", "n11"}},
      {"n[098-101]", V{"n098", "n099", "n100", "n101"}},
      {"host", V{"host"}},
      {"a,b-c,[3]x", V{"a", "b-c", "3x"}},
      {"n[5]", V{"n5"}},
      {"n[0-1,1]", V{"n0", "n1", "n1"}},
      {"gpu-[1-2]a[7,9]", V{"gpu-1a7", "gpu-1a9", "gpu-2a7", "gpu-2a9"}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.list);
    CHECK(ddp::expand_hostlist(c.list, "SLURM_JOB_NODELIST") == c.want);
    CHECK(ddp::first_host(c.list, "SLURM_JOB_NODELIST") == c.want.front());
  }
}

TEST_CASE("hostlist: malformed lists are refused, naming the variable, the list and the position") {
  const struct {
    const char* list;
    const char* why;
  } cases[] = {
      {"", "the list is empty"},
      {"node[1-2", "'[' is never closed at position 4"},
      {"node]", "']' without '[' at position 4"},
      {"node[2-1]", "a range that runs backwards"},
      {"node[]", "an empty entry in a bracket"},
      {"node[1,,2]", "an empty entry in a bracket"},
      {"node[a-b]", "something other than numbers"},
      {"node[1-[2]]", "a bracket inside a bracket at position 7"},
      {",", "an empty name at position 0"},
      {"a,,b", "an empty name at position 2"},
      {"a,", "an empty name at position 2"},
      {"node[1-]", "a range without a bound"},
      {"node[-3]", "a range without a bound"},
      {"node[1-2-3]", "something other than numbers"},
      {"n[1234567890123456789]", "more than 18 digits"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.list);
    const std::string m = refusal([&] { ddp::expand_hostlist(c.list, "SLURM_STEP_NODELIST"); });
    CAPTURE(m);
    CHECK(has(m, std::string("SLURM_STEP_NODELIST='") + c.list + "' is not a hostlist"));
    CHECK(has(m, c.why));
    CHECK(refusal([&] { ddp::first_host(c.list, "SLURM_STEP_NODELIST"); }) == m);
  }
  // Too many names to expand; the first is still known.
  CHECK(has(refusal([&] { ddp::expand_hostlist("n[0-999999],m[0-1]", "X"); }), "names more than 1000000 hosts"));
  CHECK(has(refusal([&] { ddp::expand_hostlist("a[0-999]b[0-999]c[0-9]", "X"); }), "names more than 1000000 hosts"));
  CHECK(ddp::first_host("n[000000-999999999]", "X") == "n000000");
  CHECK(ddp::expand_hostlist("n[0-999999]", "X").size() == 1000000);
}

namespace {

// Sets variables for one test and puts back what was there.
class ScopedEnv {
 public:
  explicit ScopedEnv(const EnvMap& vars) {
    for (const auto& kv : vars) {
      const char* old = std::getenv(kv.first.c_str());
      saved_.push_back({kv.first, old ? old : "", old != nullptr});
      ::setenv(kv.first.c_str(), kv.second.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const Saved& s : saved_)
      if (s.was_set)
        ::setenv(s.name.c_str(), s.value.c_str(), 1);
      else
        ::unsetenv(s.name.c_str());
  }

 private:
  struct Saved {
    std::string name, value;
    bool was_set;
  };
  std::vector<Saved> saved_;
};

// The launcher variables the process may have from the shell that ran the tests, removed for a test.
EnvMap cleared() {
  EnvMap vars;
  for (const auto& kv : ddp::process_environment())
    for (const char* prefix : {"RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_COMM_WORLD", "PMI", "MPI_LOCAL",
                               "SLURM_", "GROUP_RANK", "TORCHELASTIC", "DDP_STORE_PORT"})
      if (kv.first.compare(0, std::string(prefix).size(), prefix) == 0) vars[kv.first] = "";
  return vars;
}

}  // namespace

TEST_CASE("auto through the process's environment: the rendezvous method, env:// falling back, ddp_launcher_ranks") {
  ScopedEnv clear(cleared());
  std::string said;
  int rank = -1, size = -1;
  CHECK(ddp::resolve_launcher_method("tcp://h:1", &rank, &size, false, &said) == "tcp://h:1");
  CHECK(said.empty());
  CHECK(has(refusal([&] { ddp::resolve_launcher_method("auto", &rank, &size, false, &said); }),
            "no launcher's variables give this process a rank"));
  CHECK(has(refusal([&] { ddp::resolve_launcher_method("env://", &rank, &size, false, &said); }),
            "env:// (without RANK and WORLD_SIZE: as auto): init method auto: no launcher's variables"));
  int r = 7, n = 7, lr = 7;
  CHECK(ddp_launcher_ranks(&r, &n, &lr) == DDP_ERR_INVALID_ARGUMENT);
  CHECK(has(ddp_last_error(), "ddp_launcher_ranks: init method auto: no launcher's variables"));

  ScopedEnv slurm(EnvMap{{"SLURM_PROCID", "2"},
                         {"SLURM_NTASKS", "3"},
                         {"SLURM_LOCALID", "2"},
                         {"SLURM_NNODES", "1"},
                         {"SLURM_JOB_ID", "9"},
                         {"SLURM_STEP_ID", "1"}});
  CHECK(ddp::resolve_launcher_method("auto", &rank, &size, false, &said) == "tcp://127.0.0.1:20163");
  CHECK(rank == 2);
  CHECK(size == 3);
  CHECK(said == "auto (Slurm, 127.0.0.1:20163)");
  rank = -1, size = -1;
  CHECK(ddp::resolve_launcher_method("env://", &rank, &size, false, &said) == "tcp://127.0.0.1:20163");
  CHECK(said == "env:// (without RANK and WORLD_SIZE: as auto) (Slurm, 127.0.0.1:20163)");
  rank = 1, size = -1;
  CHECK(has(refusal([&] { ddp::resolve_launcher_method("auto", &rank, &size, false, &said); }),
            "rank 1 was given, but Slurm says SLURM_PROCID=2"));
  rank = 2, size = 4;
  CHECK(has(refusal([&] { ddp::resolve_launcher_method("auto", &rank, &size, false, &said); }),
            "size 4 was given, but Slurm says SLURM_NTASKS=3"));
  CHECK(ddp_launcher_ranks(&r, &n, &lr) == DDP_SUCCESS);
  CHECK(r == 2);
  CHECK(n == 3);
  CHECK(lr == 2);
  CHECK(ddp_launcher_ranks(nullptr, nullptr, nullptr) == DDP_SUCCESS);
  {
    ScopedEnv ipv6(EnvMap{{"MASTER_ADDR", "::1"}});
    rank = -1, size = -1;
    CHECK(ddp::resolve_launcher_method("auto", &rank, &size, false, &said) == "tcp://[::1]:20163");
  }
  {  // env:// with RANK and WORLD_SIZE stays env://; a joiner's env:// never needs them
    ScopedEnv torch(EnvMap{{"RANK", "2"}, {"WORLD_SIZE", "3"}});
    rank = -1, size = -1;
    CHECK(ddp::resolve_launcher_method("env://", &rank, &size, false, &said) == "env://");
  }
  ScopedEnv contradiction(EnvMap{{"RANK", "1"}});
  rank = -1, size = -1;
  CHECK(has(refusal([&] { ddp::resolve_launcher_method("auto", &rank, &size, false, &said); }),
            "RANK=1 (torchrun) but SLURM_PROCID=2 (Slurm)"));
  CHECK(ddp_launcher_ranks(&r, &n, &lr) == DDP_ERR_INVALID_ARGUMENT);
}
