// Whether this machine can run the GPU tests, and what it is: exits 0 and prints one line naming the
// device, the driver, the CUDA runtime and NCCL; or exits 1 with one line starting "no CUDA device:"
// that says why (no driver, a driver older than the toolkit's runtime, no visible device, a device
// that cannot take a context). tests/gpu/run.sh runs it first, so that a machine without a usable
// GPU fails the run instead of skipping every case.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

std::string cuda_version(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

int fail(const std::string& why) {
  std::printf("no CUDA device: %s\n", why.c_str());
  return 1;
}

std::string cuda_error(const char* call, cudaError_t rc) {
  return std::string(call) + " failed: " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
}

}  // namespace

int main() {
  int driver = 0, runtime = 0, count = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  cudaRuntimeGetVersion(&runtime);
  if (driver == 0)
    return fail("no CUDA driver is installed (cudaDriverGetVersion gives 0; the runtime is CUDA " +
                cuda_version(runtime) + ")");
  const std::string versions =
      "driver supports CUDA " + cuda_version(driver) + ", runtime CUDA " + cuda_version(runtime);
  // Within one major version a driver older than the runtime may still run it (minor version
  // compatibility); across major versions it cannot. Either way cudaGetDeviceCount has the last word.
  const bool old_driver = driver < runtime;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess)
    return fail(cuda_error("cudaGetDeviceCount", rc) + "; " + versions +
                (old_driver ? ": the driver is older than the toolkit, install a newer driver" : ""));
  if (count == 0) {
    const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
    return fail("cudaGetDeviceCount found 0 devices (" + versions +
                (vis ? std::string(", CUDA_VISIBLE_DEVICES=") + vis : std::string()) + ")");
  }
  cudaError_t ctx = cudaSetDevice(0);
  if (ctx == cudaSuccess) ctx = cudaFree(nullptr);  // creates the context: a driver too old fails here
  if (ctx != cudaSuccess) return fail(cuda_error("creating a context on device 0", ctx) + "; " + versions);
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return fail("cudaGetDeviceProperties failed");
  int nccl = 0;
  const bool have_nccl = ncclGetVersion(&nccl) == ncclSuccess;
  // NCCL's code is major * 10000 + minor * 100 + patch from 2.9 on (major * 1000 + minor * 100 before).
  const int nmaj = nccl >= 10000 ? nccl / 10000 : nccl / 1000,
            nmin = nccl >= 10000 ? nccl / 100 % 100 : nccl / 100 % 10;
  std::printf("device: %s (sm_%d%d, %.1f GiB, %d SMs), %d visible; %s%s; NCCL %s\n", p.name, p.major, p.minor,
              static_cast<double>(p.totalGlobalMem) / (1u << 30), p.multiProcessorCount, count, versions.c_str(),
              old_driver ? " (older driver: minor version compatibility)" : "",
              have_nccl ? (std::to_string(nmaj) + "." + std::to_string(nmin) + "." + std::to_string(nccl % 100)).c_str()
                        : "unknown (ncclGetVersion failed)");
  return 0;
}
