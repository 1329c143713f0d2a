// The environment knobs (core/knobs.hpp): numbers read strictly, a bad value warned about once through
// the log and replaced by the default, and the two knobs whose bad values fail the call that reads them.
#include <doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/common.hpp"
#include "core/knobs.hpp"
#include "ddp.h"

using namespace ddp;

namespace {

std::vector<std::string> g_logged;

// Collects the log while it lives; restores the variable it set.
struct Scope {
  const char* name;
  explicit Scope(const char* n, const char* value) : name(n) {
    g_logged.clear();
    ddp_set_log_callback([](ddp_log_level_t, const char* m, void*) { g_logged.push_back(m); }, nullptr);
    setenv(name, value, 1);
  }
  ~Scope() {
    unsetenv(name);
    ddp_set_log_callback(nullptr, nullptr);
  }
};

}  // namespace

TEST_CASE("knobs: integers are read whole and in range") {
  int64_t x = 7;
  CHECK(knobs::parse_integer("4096", 4096, 10000, &x));
  CHECK(x == 4096);
  for (const char* bad : {"", "abc", "12abc", "4095", "10001", " 5000", "5000 ", "1e4", "99999999999999999999"}) {
    x = 7;
    CHECK_FALSE(knobs::parse_integer(bad, 4096, 10000, &x));
    CHECK(x == 7);
  }
  CHECK_FALSE(knobs::parse_integer(nullptr, 0, 1, &x));
  CHECK(knobs::parse_integer("-3", -5, 5, &x));
  CHECK(x == -3);
}

TEST_CASE("knobs: DDP_HOST_PIECE_BYTES: a good value is used, a bad one warned about once and the default used") {
  {
    Scope s("DDP_HOST_PIECE_BYTES", "65536");
    CHECK(knobs::host_piece_bytes() == 65536);
    CHECK(g_logged.empty());
  }
  {
    Scope s("DDP_HOST_PIECE_BYTES", "4MB");
    CHECK(knobs::host_piece_bytes() == size_t(4) << 20);
    CHECK(knobs::host_piece_bytes() == size_t(4) << 20);
    REQUIRE(g_logged.size() == 1);  // once per value
    CHECK(g_logged[0] == "DDP_HOST_PIECE_BYTES='4MB' is not an integer in 4096..1099511627776; using 4194304");
  }
  {
    Scope s("DDP_HOST_PIECE_BYTES", "100");  // below the smallest piece
    CHECK(knobs::host_piece_bytes() == size_t(4) << 20);
    CHECK(g_logged.size() == 1);
  }
}

TEST_CASE("knobs: DDP_INIT_TIMEOUT_MS and DDP_STORE_PORT fail the call on a bad value") {
  {
    Scope s("DDP_INIT_TIMEOUT_MS", "10s");
    CHECK_THROWS_WITH_AS(knobs::init_timeout_ms(), doctest::Contains("DDP_INIT_TIMEOUT_MS is '10s'"), Error);
  }
  {
    Scope s("DDP_INIT_TIMEOUT_MS", "2500");
    CHECK(knobs::init_timeout_ms() == 2500);
  }
  CHECK(knobs::init_timeout_ms() == 300000);
  {
    Scope s("DDP_STORE_PORT", "70000");
    CHECK_THROWS_WITH_AS(knobs::store_port(29500), doctest::Contains("DDP_STORE_PORT='70000' is not a port"), Error);
  }
  CHECK(knobs::store_port(29500) == 29501);
}

TEST_CASE("knobs: ports are read whole and in 1..65535; a derived store port past 65535 is refused") {
  CHECK(knobs::port("MASTER_PORT", "29500") == 29500);
  for (const char* bad : {"0", "-1", "65536", "70000", "abc", "", " 80", "80x"}) {
    const std::string want = std::string("MASTER_PORT='") + bad + "' is not a port: expected an integer in 1..65535";
    CHECK_THROWS_WITH_AS(knobs::port("MASTER_PORT", bad), doctest::Contains(want.c_str()), Error);
  }
  CHECK(knobs::store_port(65534) == 65535);
  CHECK_THROWS_WITH_AS(knobs::store_port(65535), doctest::Contains("MASTER_PORT + 1 = 65536, outside 1..65535"), Error);
  Scope s("DDP_STORE_PORT", "65535");
  CHECK(knobs::store_port(65535) == 65535);  // named: no port is derived
}

TEST_CASE("knobs: DDP_JOB_ID, else TORCHELASTIC_RUN_ID; DDP_INIT_PROGRESS_MS") {
  {
    Scope s("TORCHELASTIC_RUN_ID", "torch-run");
    CHECK(knobs::job_id() == "torch-run");
    Scope d("DDP_JOB_ID", "mine");
    CHECK(knobs::job_id() == "mine");
  }
  CHECK(knobs::job_id() == "");
  CHECK(knobs::init_progress_ms() == 5000);
  {
    Scope s("DDP_INIT_PROGRESS_MS", "0");
    CHECK(knobs::init_progress_ms() == 0);
  }
  {
    Scope s("DDP_INIT_PROGRESS_MS", "5s");
    CHECK(knobs::init_progress_ms() == 5000);
    REQUIRE(g_logged.size() == 1);
    CHECK(g_logged[0] == "DDP_INIT_PROGRESS_MS='5s' is not an integer in 0..4611686018427387904; using 5000");
  }
}
