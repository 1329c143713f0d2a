// The C API on one rank (ddp_comm_init_self): every misuse answers with its status and a message,
// never a crash, and the status/config/version basics hold.
#include <doctest.h>

#include <cstring>
#include <thread>
#include <string>
#include <vector>

#include "ddp.h"

#define CHECK_STATUS(call, want, needle)                                                         \
  do {                                                                                           \
    ddp_status_t st_ = (call);                                                                   \
    CHECK_MESSAGE(st_ == (want), #call, " -> ", ddp_status_string(st_), ": ", ddp_last_error()); \
    CHECK_MESSAGE(has_text(ddp_last_error(), (needle)), ddp_last_error());                       \
  } while (0)

static const char* const kNone = nullptr;
static bool has_text(const char* text, const char* needle) { return !needle || std::strstr(text, needle); }

struct One {
  ddp_comm_t comm = nullptr;
  ddp_t ddp = nullptr;
  explicit One(const ddp_config_t* cfg = nullptr) {
    REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
    REQUIRE(ddp_create(comm, cfg, &ddp) == DDP_SUCCESS);
  }
  ~One() {
    ddp_destroy(ddp);
    ddp_comm_destroy(comm);
  }
};

TEST_CASE("status strings come from one table; unknown values are named") {
  CHECK(std::string(ddp_status_string(DDP_SUCCESS)) == "success");
  CHECK(std::string(ddp_status_string(DDP_ERR_TIMEOUT)) == "timed out waiting for other ranks");
  CHECK(std::string(ddp_status_string(static_cast<ddp_status_t>(999))) == "unknown status");
  for (int s = 0; s < DDP_STATUS_COUNT; ++s)
    CHECK(std::string(ddp_status_string(static_cast<ddp_status_t>(s))) != "unknown status");
  CHECK(DDP_ERR_INTERNAL == 11);
  CHECK(ddp_version() == DDP_VERSION_CODE);
}

TEST_CASE("the last error is per thread") {
  CHECK_STATUS(ddp_comm_rank(nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  std::string other;
  std::thread t([&] { other = ddp_last_error(); });
  t.join();
  CHECK(other.empty());
  CHECK(std::string(ddp_last_error()).find("ddp_comm_rank") != std::string::npos);
}

TEST_CASE("config: defaults, and every bad field is refused with its name") {
  ddp_config_t c;
  REQUIRE(ddp_config_init(&c) == DDP_SUCCESS);
  const ddp_config_t i = DDP_CONFIG_INITIALIZER;  // field by field: padding bytes are unspecified
  CHECK(c.size == i.size);
  CHECK(c.magic == i.magic);
  CHECK(c.version == i.version);
  CHECK(c.message_size == i.message_size);
  CHECK(c.delay_allreduce == i.delay_allreduce);
  CHECK(c.layout == i.layout);
  CHECK(c.plan_order == i.plan_order);
  CHECK(c.allreduce_always_fp32 == i.allreduce_always_fp32);
  CHECK(c.gradient_average == i.gradient_average);
  CHECK(c.gradient_predivide_factor == i.gradient_predivide_factor);
  CHECK(c.num_streams == i.num_streams);
  CHECK(c.stream_comms == i.stream_comms);
  CHECK(c.timeout_ms == i.timeout_ms);
  CHECK(c.unused_policy == i.unused_policy);
  CHECK(c.timeline_path == i.timeline_path);
  CHECK(c.check_finite == i.check_finite);
  CHECK(c.inplace_min_numel == i.inplace_min_numel);
  CHECK(c.host_piece_bytes == i.host_piece_bytes);
  CHECK(c.size == sizeof(ddp_config_t));
  CHECK(c.version == DDP_CONFIG_VERSION);
  CHECK(c.message_size == 10000000u);
  CHECK(c.gradient_average == 1);
  CHECK(c.gradient_predivide_factor == 1.0);
  CHECK(c.num_streams == 1);
  CHECK_STATUS(ddp_config_init(nullptr), DDP_ERR_INVALID_ARGUMENT, "config");
  CHECK_STATUS(ddp_config_init_sized(&c, DDP_CONFIG_V1_SIZE - 1), DDP_ERR_INVALID_ARGUMENT, "first version");

  ddp_comm_t comm;
  REQUIRE(ddp_comm_init_self(&comm) == DDP_SUCCESS);
  struct Bad {
    const char* needle;
    void (*edit)(ddp_config_t*);
  };
  const Bad bad[] = {
      {"config->size", [](ddp_config_t* x) { x->size = 8; }},
      {"config->magic", [](ddp_config_t* x) { x->magic = 1; }},
      {"config->version", [](ddp_config_t* x) { x->version = 0; }},
      {"message_size", [](ddp_config_t* x) { x->message_size = 0; }},
      {"layout", [](ddp_config_t* x) { x->layout = 7; }},
      {"plan_order", [](ddp_config_t* x) { x->plan_order = -1; }},
      {"gradient_predivide_factor", [](ddp_config_t* x) { x->gradient_predivide_factor = 0.0; }},
      {"gradient_predivide_factor", [](ddp_config_t* x) { x->gradient_predivide_factor = -2.0; }},
      {"gradient_predivide_factor", [](ddp_config_t* x) { x->gradient_predivide_factor = 1.0 / 0.0; }},
      {"num_streams", [](ddp_config_t* x) { x->num_streams = 0; }},
      {"num_streams", [](ddp_config_t* x) { x->num_streams = 65; }},
      {"timeout_ms", [](ddp_config_t* x) { x->timeout_ms = -1; }},
      {"unused_policy", [](ddp_config_t* x) { x->unused_policy = 2; }},
      {"host_piece_bytes", [](ddp_config_t* x) { x->host_piece_bytes = 4095; }},
      {"host_piece_bytes", [](ddp_config_t* x) { x->host_piece_bytes = SIZE_MAX; }},
      {"_FP16 (2) or _INT8 (3)", [](ddp_config_t* x) { x->compression = 4; }},
      {"compression", [](ddp_config_t* x) { x->compression = -1; }},
      {"config.elastic is not available with config.shard",
       [](ddp_config_t* x) {
         x->elastic = 1;
         x->shard = 1;
         x->layout = DDP_LAYOUT_ARENA;
         x->plan_order = DDP_PLAN_REGISTRATION;
       }},
      {"config.elastic is not available with config.uneven_inputs",
       [](ddp_config_t* x) {
         x->elastic = 1;
         x->uneven_inputs = DDP_UNEVEN_BY_WORLD;
       }},
      {"config.elastic is not available with config.stream_comms",
       [](ddp_config_t* x) {
         static ddp_comm_t one[1] = {nullptr};
         x->elastic = 1;
         x->stream_comms = one;
       }},
      {"DDP_COMPRESS_INT8 is not available with config.shard",
       [](ddp_config_t* x) {
         x->compression = DDP_COMPRESS_INT8;
         x->shard = 1;
         x->layout = DDP_LAYOUT_ARENA;
         x->plan_order = DDP_PLAN_REGISTRATION;
       }},
  };
  for (const Bad& b : bad) {
    ddp_config_t x = DDP_CONFIG_INITIALIZER;
    b.edit(&x);
    ddp_t d = reinterpret_cast<ddp_t>(0x1);
    CHECK_STATUS(ddp_create(comm, &x, &d), DDP_ERR_INVALID_ARGUMENT, b.needle);
    CHECK(d == reinterpret_cast<ddp_t>(0x1));  // out-pointer untouched on failure
  }
  // stream_comms: NULL entries and comms of another size are refused.
  ddp_comm_t none[2] = {comm, nullptr};
  ddp_config_t x = DDP_CONFIG_INITIALIZER;
  x.num_streams = 2;
  x.stream_comms = none;
  ddp_t d;
  CHECK_STATUS(ddp_create(comm, &x, &d), DDP_ERR_INVALID_ARGUMENT, "stream_comms[1]");
  ddp_local_group_t g;
  REQUIRE(ddp_local_group_create(2, &g) == DDP_SUCCESS);
  ddp_comm_t two;
  REQUIRE(ddp_comm_init_local(g, 0, &two) == DDP_SUCCESS);
  ddp_comm_t wrong[1] = {two};
  x.num_streams = 1;
  x.stream_comms = wrong;
  CHECK_STATUS(ddp_create(comm, &x, &d), DDP_ERR_INVALID_ARGUMENT, "spans 2 ranks");
  ddp_comm_destroy(two);
  ddp_local_group_destroy(g);
  // A larger struct from a newer caller is read up to what this library knows.
  struct Bigger {
    ddp_config_t c;
    char extra[32];
  } big;
  std::memset(&big, 0, sizeof big);
  ddp_config_init(&big.c);
  big.c.size = sizeof big;
  CHECK_STATUS(ddp_create(comm, &big.c, &d), DDP_SUCCESS, kNone);
  ddp_destroy(d);
  ddp_comm_destroy(comm);
}

TEST_CASE("NULL handles and pointers") {
  int i = 0;
  void* p = nullptr;
  float f[4];
  CHECK_STATUS(ddp_comm_init_self(nullptr), DDP_ERR_INVALID_ARGUMENT, "comm is NULL");
  CHECK_STATUS(ddp_create(nullptr, nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "ddp_comm_t handle is NULL");
  CHECK_STATUS(ddp_register_grad(nullptr, f, 4, DDP_F32, 0, &i), DDP_ERR_INVALID_ARGUMENT, "ddp_t handle is NULL");
  CHECK_STATUS(ddp_begin_backward(nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_grad_ready(nullptr, 0), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_finish_backward(nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_grad_ptr(nullptr, 0, &p), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_set_sync(nullptr, 1), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_reduce_all(nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_synchronize(nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_get_stats(nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_get_plan(nullptr, &i, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  CHECK_STATUS(ddp_comm_init_local(nullptr, 0, nullptr), DDP_ERR_INVALID_ARGUMENT, "group is NULL");
  CHECK_STATUS(ddp_destroy(nullptr), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_comm_destroy(nullptr), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_local_group_destroy(nullptr), DDP_SUCCESS, kNone);
  One o;
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 4, DDP_F32, 0, nullptr), DDP_ERR_INVALID_ARGUMENT, "index is NULL");
  CHECK_STATUS(ddp_register_grad(o.ddp, nullptr, 4, DDP_F32, 0, &i), DDP_ERR_INVALID_ARGUMENT, "grad is NULL");
  CHECK_STATUS(ddp_grad_ptr(o.ddp, 0, nullptr), DDP_ERR_INVALID_ARGUMENT, "grad is NULL");
  CHECK_STATUS(ddp_get_plan(o.ddp, nullptr, nullptr), DDP_ERR_INVALID_ARGUMENT, "num_buckets");
  CHECK_STATUS(ddp_get_bucket(o.ddp, 0, nullptr, nullptr, 0), DDP_ERR_INVALID_ARGUMENT, "info");
  ddp_stats_t s;
  s.size = 4;
  CHECK_STATUS(ddp_get_stats(o.ddp, &s), DDP_ERR_INVALID_ARGUMENT, "sizeof(ddp_stats_t)");
}

TEST_CASE("registration: bad numel, dtype, flags; closed after the first backward") {
  One o;
  float f[8] = {0};
  int i = -1;
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 0, DDP_F32, 0, &i), DDP_ERR_INVALID_ARGUMENT, "numel is 0");
  CHECK_STATUS(ddp_register_grad(o.ddp, f, SIZE_MAX, DDP_F32, 0, &i), DDP_ERR_INVALID_ARGUMENT, "too large");
  CHECK_STATUS(ddp_register_grad(o.ddp, f, SIZE_MAX / 2, DDP_F64, 0, &i), DDP_ERR_INVALID_ARGUMENT, "too large");
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 8, static_cast<ddp_dtype_t>(4), 0, &i), DDP_ERR_INVALID_ARGUMENT, "dtype 4");
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 8, static_cast<ddp_dtype_t>(-1), 0, &i), DDP_ERR_INVALID_ARGUMENT,
               "dtype -1");
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 8, DDP_F32, 0x10, &i), DDP_ERR_INVALID_ARGUMENT, "unknown flags");
  CHECK(i == -1);
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 8, DDP_F32, 0, &i), DDP_SUCCESS, kNone);
  CHECK(i == 0);
  CHECK_STATUS(ddp_begin_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 8, DDP_F32, 0, &i), DDP_ERR_INVALID_STATE, "registration is closed");
}

TEST_CASE("call order: ready outside backward, twice, out of range; nested begin; finish without begin") {
  One o;
  float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[3] = {1, 1, 1};
  int ia, ib;
  REQUIRE(ddp_register_grad(o.ddp, a, 8, DDP_F32, 0, &ia) == DDP_SUCCESS);
  REQUIRE(ddp_register_grad(o.ddp, b, 3, DDP_F32, 0, &ib) == DDP_SUCCESS);
  CHECK_STATUS(ddp_grad_ready(o.ddp, ia), DDP_ERR_INVALID_STATE, "call ddp_begin_backward first");
  CHECK_STATUS(ddp_finish_backward(o.ddp, nullptr), DDP_ERR_INVALID_STATE, "no backward pass in progress");
  CHECK_STATUS(ddp_begin_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_begin_backward(o.ddp, nullptr), DDP_ERR_INVALID_STATE, "already in progress");
  CHECK_STATUS(ddp_grad_ready(o.ddp, 2), DDP_ERR_INVALID_ARGUMENT, "grad index 2 out of range (2 grads registered)");
  CHECK_STATUS(ddp_grad_ready(o.ddp, -1), DDP_ERR_INVALID_ARGUMENT, "out of range");
  CHECK_STATUS(ddp_grad_ready(o.ddp, ia), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_grad_ready(o.ddp, ia), DDP_ERR_INVALID_STATE, "grad 0 was already marked ready");
  CHECK_STATUS(ddp_set_sync(o.ddp, 0), DDP_ERR_INVALID_STATE, "inside a backward pass");
  CHECK_STATUS(ddp_reduce_all(o.ddp, nullptr), DDP_ERR_INVALID_STATE, "inside a backward pass");
  CHECK_STATUS(ddp_set_grad_ptr(o.ddp, ia, a), DDP_ERR_INVALID_STATE, "already marked ready");
  CHECK_STATUS(ddp_grad_ready(o.ddp, ib), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_finish_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
  CHECK(a[7] == 8.0f);  // world size 1: the mean is the value
  // The context stays usable after refused calls.
  CHECK_STATUS(ddp_begin_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_grad_ready(o.ddp, ia), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_grad_ready(o.ddp, ib), DDP_SUCCESS, kNone);
  CHECK_STATUS(ddp_finish_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
  int nb = 0, learned = 0;
  CHECK_STATUS(ddp_get_plan(o.ddp, &nb, &learned), DDP_SUCCESS, kNone);
  CHECK(learned == 1);
  ddp_bucket_info_t info;
  info.size = sizeof info;
  CHECK_STATUS(ddp_get_bucket(o.ddp, nb, &info, nullptr, 0), DDP_ERR_INVALID_ARGUMENT, "out of range");
  CHECK_STATUS(ddp_get_bucket(o.ddp, 0, &info, nullptr, 3), DDP_ERR_INVALID_ARGUMENT, "grads is NULL");
  ddp_stats_t s;
  s.size = sizeof s;
  CHECK_STATUS(ddp_get_stats(o.ddp, &s), DDP_SUCCESS, kNone);
  CHECK(s.iterations == 2);
  CHECK(s.world_size == 1);
}

TEST_CASE("unused grads: error policy names them, zero policy reduces zeros") {
  for (int policy : {DDP_UNUSED_ERROR, DDP_UNUSED_ZERO}) {
    ddp_config_t c = DDP_CONFIG_INITIALIZER;
    c.unused_policy = policy;
    One o(&c);
    std::vector<float> g[3] = {std::vector<float>(5, 2.0f), std::vector<float>(6, 2.0f), std::vector<float>(7, 2.0f)};
    int idx[3];
    for (int k = 0; k < 3; ++k)
      REQUIRE(ddp_register_grad(o.ddp, g[k].data(), g[k].size(), DDP_F32, 0, &idx[k]) == DDP_SUCCESS);
    REQUIRE(ddp_begin_backward(o.ddp, nullptr) == DDP_SUCCESS);
    REQUIRE(ddp_grad_ready(o.ddp, idx[1]) == DDP_SUCCESS);
    if (policy == DDP_UNUSED_ERROR)
      CHECK_STATUS(ddp_finish_backward(o.ddp, nullptr), DDP_ERR_INVALID_STATE, "rank 0: grads 0, 2");
    else
      CHECK_STATUS(ddp_finish_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
    CHECK(g[0][0] == 0.0f);  // reduced as zeros in both policies
    CHECK(g[1][0] == 2.0f);
    CHECK(g[2][6] == 0.0f);
    // the next iteration with every grad ready is clean again
    for (auto& v : g) std::fill(v.begin(), v.end(), 3.0f);
    REQUIRE(ddp_begin_backward(o.ddp, nullptr) == DDP_SUCCESS);
    for (int k = 0; k < 3; ++k) REQUIRE(ddp_grad_ready(o.ddp, idx[k]) == DDP_SUCCESS);
    CHECK_STATUS(ddp_finish_backward(o.ddp, nullptr), DDP_SUCCESS, kNone);
    CHECK(g[0][0] == 3.0f);
    CHECK(g[2][6] == 3.0f);
  }
}

TEST_CASE("arena layout: library-owned storage, NULL required, pointer setters refused") {
  ddp_config_t c = DDP_CONFIG_INITIALIZER;
  c.layout = DDP_LAYOUT_ARENA;
  c.message_size = 4;
  One o(&c);
  float f[4];
  int i, j;
  CHECK_STATUS(ddp_register_grad(o.ddp, f, 4, DDP_F32, 0, &i), DDP_ERR_INVALID_ARGUMENT, "pass NULL");
  REQUIRE(ddp_register_grad(o.ddp, nullptr, 4, DDP_F32, 0, &i) == DDP_SUCCESS);
  REQUIRE(ddp_register_grad(o.ddp, nullptr, 3, DDP_F64, 0, &j) == DDP_SUCCESS);
  void* p = nullptr;
  REQUIRE(ddp_grad_ptr(o.ddp, i, &p) == DDP_SUCCESS);  // closes registration
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(p) % 256 == 0);
  CHECK(static_cast<float*>(p)[3] == 0.0f);  // zeroed
  CHECK_STATUS(ddp_register_grad(o.ddp, nullptr, 4, DDP_F32, 0, &i), DDP_ERR_INVALID_STATE, "closed");
  CHECK_STATUS(ddp_set_grad_ptr(o.ddp, i, f), DDP_ERR_INVALID_STATE, "arena");
  CHECK_STATUS(ddp_grad_ptr(o.ddp, 5, &p), DDP_ERR_INVALID_ARGUMENT, "out of range");
  REQUIRE(ddp_begin_backward(o.ddp, nullptr) == DDP_SUCCESS);
  CHECK_STATUS(ddp_grad_ready_ptr(o.ddp, i, f), DDP_ERR_INVALID_STATE, "arena");
  // Every message starts with the entry point that failed, named once.
  const std::string m = ddp_last_error();
  CHECK(m.rfind("ddp_grad_ready_ptr: ", 0) == 0);
  CHECK(m.find("ddp_grad_ready_ptr", 1) == std::string::npos);
  CHECK_STATUS(ddp_grad_ready(o.ddp, 99), DDP_ERR_INVALID_ARGUMENT, "ddp_grad_ready: grad index 99 out of range");
  ddp_stats_t s;
  s.size = sizeof s;
  REQUIRE(ddp_get_stats(o.ddp, &s) == DDP_SUCCESS);
  CHECK(s.arena_bytes >= 4 * 4 + 3 * 8);
}

TEST_CASE("copy layout: moved grads are followed (set_to_none style)") {
  One o;
  std::vector<float> a(10, 1.0f), b(10, 5.0f);
  int i;
  REQUIRE(ddp_register_grad(o.ddp, a.data(), 10, DDP_F32, 0, &i) == DDP_SUCCESS);
  CHECK_STATUS(ddp_set_grad_ptr(o.ddp, i, nullptr), DDP_ERR_INVALID_ARGUMENT, "NULL");
  REQUIRE(ddp_set_grad_ptr(o.ddp, i, b.data()) == DDP_SUCCESS);
  void* p;
  REQUIRE(ddp_grad_ptr(o.ddp, i, &p) == DDP_SUCCESS);
  CHECK(p == b.data());
  ddp_config_t c = DDP_CONFIG_INITIALIZER;
  c.gradient_average = 0;
  c.gradient_predivide_factor = 2.0;  // sum / 2 on one rank
  One q(&c);
  REQUIRE(ddp_register_grad(q.ddp, a.data(), 10, DDP_F32, 0, &i) == DDP_SUCCESS);
  REQUIRE(ddp_begin_backward(q.ddp, nullptr) == DDP_SUCCESS);
  REQUIRE(ddp_grad_ready_ptr(q.ddp, i, b.data()) == DDP_SUCCESS);
  REQUIRE(ddp_finish_backward(q.ddp, nullptr) == DDP_SUCCESS);
  CHECK(b[9] == 2.5f);
  CHECK(a[9] == 1.0f);
}
