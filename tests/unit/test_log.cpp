// The log's settings: how DDP_DEBUG is read (the values it knows, in any case) and what an unknown
// value is told. The environment itself is read once per process, so the end-to-end runs (the plan
// logs, the warning for an unknown value) are in the python suite, in child processes.
#include <doctest.h>

#include <string>

#include "core/log.hpp"

using ddp::DebugLevel;

static DebugLevel level_of(const char* value, bool* known) {
  DebugLevel l = DebugLevel::Info;
  *known = ddp::parse_debug_level(value, &l);
  return l;
}

TEST_CASE("DDP_DEBUG: the known values in any case, unset and empty are the default") {
  const struct {
    const char* value;
    DebugLevel want;
  } cases[] = {{nullptr, DebugLevel::Warn}, {"", DebugLevel::Warn},        {"INFO", DebugLevel::Info},
               {"info", DebugLevel::Info},  {"Info", DebugLevel::Info},    {"WARN", DebugLevel::Warn},
               {"warn", DebugLevel::Warn},  {"warning", DebugLevel::Warn}, {"OFF", DebugLevel::Off},
               {"off", DebugLevel::Off},    {"None", DebugLevel::Off}};
  for (const auto& c : cases) {
    CAPTURE(c.value ? c.value : "(unset)");
    bool known = false;
    CHECK(level_of(c.value, &known) == c.want);
    CHECK(known);
  }
}

TEST_CASE("DDP_DEBUG: an unknown value is reported, keeps the default, and the message names what is accepted") {
  for (const char* v : {"verbose", "debug", "1", "INFO ", "trace"}) {
    CAPTURE(v);
    bool known = true;
    CHECK(level_of(v, &known) == DebugLevel::Warn);
    CHECK_FALSE(known);
  }
  const std::string m = ddp::unknown_debug_message("verbose");
  CAPTURE(m);
  CHECK(m.find("DDP_DEBUG='verbose'") != std::string::npos);
  for (const char* accepted : {"INFO", "WARN", "OFF", "NONE", "any case"}) CHECK(m.find(accepted) != std::string::npos);
}
