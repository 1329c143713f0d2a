/* tests/abi: the checks shared by the ABI callers. Each caller includes its own ddp.h (the frozen 0.1
 * header, a generated future one, or today's) before this file, so this file needs only what every
 * version of the header has: ddp_last_error. Checks may run on several threads at once. */
#ifndef ABI_CHECK_H_
#define ABI_CHECK_H_

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t abi_mu = PTHREAD_MUTEX_INITIALIZER;
static int abi_passed = 0, abi_failed = 0;
static const char* abi_name = "abi";

/* Counts one check; a failing one is printed with the calling thread's last libddp error. */
static void check(int ok, const char* what, ...) {
  va_list ap;
  pthread_mutex_lock(&abi_mu);
  if (ok) {
    ++abi_passed;
  } else {
    ++abi_failed;
    printf("%s: FAIL ", abi_name);
    va_start(ap, what);
    vprintf(what, ap);
    va_end(ap);
    printf(" (last error: %s)\n", ddp_last_error());
  }
  pthread_mutex_unlock(&abi_mu);
}

/* A call that must fail with `status` and a last-error message that contains `needle`. */
static inline void check_refused(ddp_status_t got, ddp_status_t status, const char* needle, const char* what) {
  check(got == status, "%s: status %d, expected %d", what, (int)got, (int)status);
  check(strstr(ddp_last_error(), needle) != NULL, "%s: the message names '%s'", what, needle);
}

/* True when the `n` bytes at `p` all equal `b`. */
static inline int all_bytes(const void* p, size_t n, unsigned char b) {
  const unsigned char* c = (const unsigned char*)p;
  size_t i;
  for (i = 0; i < n; ++i)
    if (c[i] != b) return 0;
  return 1;
}

/* Prints the summary line and gives the exit status. */
static int summary(void) {
  printf("%s: %d passed, %d failed\n", abi_name, abi_passed, abi_failed);
  return abi_failed == 0 ? 0 : 1;
}

#endif /* ABI_CHECK_H_ */
