/* The NCCL entry points where no CUDA device can be used (run with CUDA_VISIBLE_DEVICES= so that
 * it tests the same path on any machine). argv[1] is 1 when the library has the CUDA backend: then
 * each call must fail with DDP_ERR_CUDA and a message naming the missing device; without the
 * backend, with DDP_ERR_UNSUPPORTED naming the build. Never a crash, and out-pointers untouched. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp.h"

static int passed, failed;

static void expect(const char* what, ddp_status_t got, ddp_status_t want, const char* needle) {
  const char* msg = ddp_last_error();
  int ok = got == want && (needle == NULL || strstr(msg, needle) != NULL);
  if (ok) {
    ++passed;
    printf("  ok   %s: %s: %s\n", what, ddp_status_string(got), msg);
  } else {
    ++failed;
    printf("  FAIL %s: got %s (%d), want %s (%d) with \"%s\" in the message: \"%s\"\n", what, ddp_status_string(got),
           (int)got, ddp_status_string(want), (int)want, needle ? needle : "", msg);
  }
}

static void expect_untouched(const char* what, ddp_comm_t comm) {
  if (comm == NULL) {
    ++passed;
  } else {
    ++failed;
    printf("  FAIL %s: the out-pointer was written on failure\n", what);
  }
}

int main(int argc, char** argv) {
  const int cuda = argc > 1 && atoi(argv[1]) == 1;
  const ddp_status_t want = cuda ? DDP_ERR_CUDA : DDP_ERR_UNSUPPORTED;
  const char* needle = cuda ? "device" : "without CUDA";
  ddp_nccl_id_t id;
  ddp_comm_t comm = NULL;
  memset(&id, 0, sizeof id);
  printf("nccl-nodevice: library %s the CUDA backend\n", cuda ? "has" : "lacks");

  expect("ddp_nccl_get_unique_id", ddp_nccl_get_unique_id(&id), want, needle);
  expect("ddp_comm_init_nccl", ddp_comm_init_nccl(&id, 1, 0, 0, &comm), want, needle);
  expect_untouched("ddp_comm_init_nccl", comm);
  expect("ddp_comm_init_nccl (device 3)", ddp_comm_init_nccl(&id, 1, 0, 3, &comm), want, needle);
  expect("ddp_comm_init_nccl_mpi", ddp_comm_init_nccl_mpi(NULL, 0, &comm), want, needle);
  expect_untouched("ddp_comm_init_nccl_mpi", comm);
  expect("ddp_comm_init_nccl_timeout", ddp_comm_init_nccl_timeout(&id, 1, 0, 0, 1000, &comm), want, needle);
  expect_untouched("ddp_comm_init_nccl_timeout", comm);
  expect("ddp_comm_init_nccl_mpi_timeout", ddp_comm_init_nccl_mpi_timeout(NULL, 0, 1000, &comm), want, needle);
  expect_untouched("ddp_comm_init_nccl_mpi_timeout", comm);
  expect("ddp_comm_join_nccl", ddp_comm_join_nccl("file:///nonexistent-libddp-store", 0, 1000, &comm), want, needle);
  expect_untouched("ddp_comm_join_nccl", comm);
  /* A pointer that is no communicator at all must not be touched when no device exists. */
  expect("ddp_comm_wrap_nccl", ddp_comm_wrap_nccl((void*)(size_t)0x1000, &comm), want, needle);
  expect_untouched("ddp_comm_wrap_nccl", comm);
  /* Argument checks come first, in every build. */
  expect("ddp_comm_init_nccl(id NULL)", ddp_comm_init_nccl(NULL, 1, 0, 0, &comm), DDP_ERR_INVALID_ARGUMENT, "id");
  expect("ddp_comm_init_nccl(rank 1 of 1)", ddp_comm_init_nccl(&id, 1, 1, 0, &comm), DDP_ERR_INVALID_ARGUMENT, "rank");
  expect("ddp_nccl_get_unique_id(NULL)", ddp_nccl_get_unique_id(NULL), DDP_ERR_INVALID_ARGUMENT, "id");
  expect("ddp_comm_init_nccl_timeout(-1)", ddp_comm_init_nccl_timeout(&id, 1, 0, 0, -1, &comm),
         DDP_ERR_INVALID_ARGUMENT, "timeout_ms is -1");
  expect("ddp_comm_wrap_nccl(NULL)", ddp_comm_wrap_nccl(NULL, &comm), DDP_ERR_INVALID_ARGUMENT, "nccl_comm");
  expect("ddp_comm_join_nccl(device -1)", ddp_comm_join_nccl("env://", -1, 1000, &comm), DDP_ERR_INVALID_ARGUMENT,
         "cuda_device is -1");
  expect("ddp_comm_join_nccl(timeout -1)", ddp_comm_join_nccl("env://", 0, -1, &comm), DDP_ERR_INVALID_ARGUMENT,
         "timeout_ms is -1");
  expect("ddp_comm_join_nccl(comm NULL)", ddp_comm_join_nccl("env://", 0, 1000, NULL), DDP_ERR_INVALID_ARGUMENT,
         "comm");
  /* The host path still works in the same process. */
  {
    ddp_comm_t self = NULL;
    int size = 0;
    ddp_status_t rc = ddp_comm_init_self(&self);
    if (rc == DDP_SUCCESS) rc = ddp_comm_size(self, &size);
    expect("ddp_comm_init_self after the failures", rc, DDP_SUCCESS, NULL);
    ddp_comm_destroy(self);
  }
  printf("nccl-nodevice: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
