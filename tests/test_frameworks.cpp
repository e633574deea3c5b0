/* gcalloc called exactly as the frameworks call it (label `frameworks`):
 * C++, with the framework's own types and casts. The stand-in for
 * torch_npu's library (fake_torch_npu.cpp, in both forms its releases
 * take) holds gcalloc's exported hooks as std::function, cast from their
 * addresses as torch_npu's Module.cpp casts them, and calls them with its
 * NPUStream objects as NPUPluggableAllocator does; the AscendCL stand-in
 * (fake_acl.c) underneath refuses stream handles it did not create, as the
 * runtime does. Each case runs in a child process: the drop-in's allocator
 * is one per process.
 *
 * A plain program (no cmocka, which is C): each case prints its name, and a
 * failed check prints what and where and fails the run. */
#include <dlfcn.h>
#include <setjmp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "gcalloc.h"

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      _exit(1);                                                               \
    }                                                                         \
  } while (0)

namespace {
constexpr size_t MiB = (size_t)1 << 20;

/* The stand-ins' entry points, from their libraries. */
struct TorchNpu {
  void *lib = nullptr;
  int (*set_stream_hook)(const char *, uint64_t) = nullptr;
  int (*record_stream)(void *, int, int64_t) = nullptr;
  int (*erase_stream)(void *, int, int64_t) = nullptr;
  void *(*stream_handle)(int, int64_t) = nullptr;
  const char *(*failure)() = nullptr;
  void *accessor = nullptr; /* c10_npu::NPUStream::stream(bool) const */
  void *drain = nullptr;    /* c10_npu::npuSynchronizeDevice(bool) */
  void (*gil_acquire)() = nullptr;
  void (*gil_release)() = nullptr;
  int (*gil_waiting)() = nullptr;
  void (*throw_next_drain)(const char *) = nullptr;
};

struct Acl {
  void *lib = nullptr;
  void (*set_capacity)(size_t) = nullptr;
  void (*queue_work)(uintptr_t, size_t) = nullptr;
  size_t (*stale_work)() = nullptr;
  void (*hold_events)(int) = nullptr;
  void (*complete_stream)(void *) = nullptr;
  unsigned long (*bad_streams)() = nullptr;
  int (*set_current)(int) = nullptr;
  int (*init)(const char *) = nullptr;
};

template <typename T>
void find(void *lib, const char *name, T &out) {
  out = reinterpret_cast<T>(dlsym(lib, name));
  if (!out) {
    fprintf(stderr, "no %s: %s\n", name, dlerror());
    _exit(1);
  }
}

TorchNpu load_torch_npu(const char *path) {
  TorchNpu t;
  t.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!t.lib) {
    fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
    _exit(1);
  }
  find(t.lib, "fake_torch_npu_set_stream_hook", t.set_stream_hook);
  find(t.lib, "fake_torch_npu_record_stream", t.record_stream);
  find(t.lib, "fake_torch_npu_erase_stream", t.erase_stream);
  find(t.lib, "fake_torch_npu_stream_handle", t.stream_handle);
  find(t.lib, "fake_torch_npu_failure", t.failure);
  find(t.lib, "_ZNK7c10_npu9NPUStream6streamEb", t.accessor);
  find(t.lib, "_ZN7c10_npu20npuSynchronizeDeviceEb", t.drain);
  find(t.lib, "fake_torch_npu_gil_acquire", t.gil_acquire);
  find(t.lib, "fake_torch_npu_gil_release", t.gil_release);
  find(t.lib, "fake_torch_npu_gil_waiting", t.gil_waiting);
  find(t.lib, "fake_torch_npu_throw_next_drain", t.throw_next_drain);
  return t;
}

Acl load_acl() {
  Acl a;
  a.lib = dlopen(FAKE_ACL_PATH, RTLD_NOW | RTLD_LOCAL);
  CHECK(a.lib);
  find(a.lib, "fakeacl_hold_events", a.hold_events);
  find(a.lib, "fakeacl_complete_stream", a.complete_stream);
  find(a.lib, "fakeacl_bad_streams", a.bad_streams);
  find(a.lib, "fakeacl_set_current", a.set_current);
  find(a.lib, "aclInit", a.init);
  find(a.lib, "fakeacl_set_capacity", a.set_capacity);
  find(a.lib, "fakeacl_queue_work", a.queue_work);
  find(a.lib, "fakeacl_stale_work", a.stale_work);
  return a;
}

/* The address of a gcalloc function as torch_npu's bindings receive it
 * (an integer from ctypes). */
template <typename F>
uint64_t address(F *fn) {
  return reinterpret_cast<uint64_t>(reinterpret_cast<void *>(fn));
}

int64_t active_bytes(int device) {
  gca_stats_t s;
  CHECK(gca_get_stats(gca_torch_allocator(), device, &s) == GCA_OK);
  return s.active_bytes[GCA_POOL_ALL].current;
}

/* Errors gcalloc logs, counted. */
std::atomic<int> errors_logged;
void count_errors(gca_log_level level, const char *message, void *user) {
  (void)user;
  if (level <= GCA_LOG_ERROR) {
    errors_logged++;
    fprintf(stderr, "logged: %s\n", message);
  }
}

/* The drop-in opened on the AscendCL stand-in after torch_npu's lazy
 * initialization (aclInit, the thread's device set). */
Acl start() {
  setenv("GCALLOC_ACL_LIBRARY", FAKE_ACL_PATH, 1);
  Acl acl = load_acl();
  CHECK(acl.init(nullptr) == 0);
  CHECK(acl.set_current(0) == 0);
  CHECK(gca_torch_defer("acl", "") == GCA_OK);
  gca_set_log_handler(count_errors, nullptr);
  return acl;
}

/* The stand-in at `library` with gcalloc's object hooks set, as install()
 * sets them for a release that passes the stream object. */
TorchNpu with_object_hooks(const char *library) {
  TorchNpu t = load_torch_npu(library);
  CHECK(gca_npu_set_stream_accessor(t.accessor) == GCA_OK);
  CHECK(t.set_stream_hook("set_record_stream_fn", address(gca_npu_record_stream_object)) == 0);
  CHECK(t.set_stream_hook("set_erase_stream_fn", address(gca_npu_erase_stream_object)) == 0);
  return t;
}

/* A stream use recorded by the hooks holds the block's free until that
 * stream's work completes, and only that stream's; an erased one does
 * not; the runtime never sees a handle it did not make. */
void uses_reach_the_runtime_stream(const TorchNpu &t, const Acl &acl) {
  void *s0 = t.stream_handle(0, 0), *s1 = t.stream_handle(0, 1), *s2 = t.stream_handle(0, 2);
  CHECK(s0 && s1 && s2 && s0 != s1);
  acl.hold_events(1);
  void *p = gca_npu_malloc(4 * MiB, 0, s0);
  CHECK(p);
  CHECK(t.record_stream(p, 0, 1) == 0);
  gca_npu_free(p, 4 * MiB, 0, s0);
  CHECK(active_bytes(0) >= (int64_t)(4 * MiB)); /* the free waits for stream 1 */
  acl.complete_stream(s2);                      /* another stream's work: still waiting */
  gca_npu_free(gca_npu_malloc(MiB, 0, s0), MiB, 0, s0);
  CHECK(active_bytes(0) >= (int64_t)(4 * MiB));
  acl.complete_stream(s1);
  gca_npu_free(gca_npu_malloc(MiB, 0, s0), MiB, 0, s0); /* (the next allocation completes the free) */
  CHECK(active_bytes(0) == 0);
  p = gca_npu_malloc(4 * MiB, 0, s0);
  CHECK(t.record_stream(p, 0, 1) == 0);
  CHECK(t.erase_stream(p, 0, 1) == 0);
  gca_npu_free(p, 4 * MiB, 0, s0);
  CHECK(active_bytes(0) == 0);
  acl.hold_events(0);
  CHECK(acl.bad_streams() == 0);
  CHECK(errors_logged == 0);
}

/* torch_npu releases whose setter takes std::function<void(void *,
 * NPUStream)>: the object hooks, reading the stream through torch_npu's
 * accessor. */
void object_hooks_with_object_releases() {
  Acl acl = start();
  TorchNpu t = with_object_hooks(FAKE_TORCH_NPU_PATH);
  uses_reach_the_runtime_stream(t, acl);
}

/* Releases whose setter takes std::function<void(void *, aclrtStream)>:
 * the handle hooks (the NPUStream is converted at the call). */
void handle_hooks_with_handle_releases() {
  Acl acl = start();
  TorchNpu t = load_torch_npu(FAKE_TORCH_NPU_HANDLES_PATH);
  CHECK(t.set_stream_hook("set_record_stream_fn", address(gca_torch_record_stream)) == 0);
  CHECK(t.set_stream_hook("set_erase_stream_fn", address(gca_npu_erase_stream)) == 0);
  uses_reach_the_runtime_stream(t, acl);
}

/* The stand-in's teeth: a handle hook under an object release gets the
 * address of torch_npu's temporary NPUStream, and the runtime refuses it
 * (an error or a crash on the real one; the cross-stream use is lost). */
void handle_hook_under_an_object_release_is_caught() {
  Acl acl = start();
  TorchNpu t = load_torch_npu(FAKE_TORCH_NPU_PATH);
  CHECK(t.set_stream_hook("set_record_stream_fn", address(gca_torch_record_stream)) == 0);
  void *s0 = t.stream_handle(0, 0);
  void *p = gca_npu_malloc(MiB, 0, s0);
  CHECK(t.record_stream(p, 0, 1) == 0);
  gca_npu_free(p, MiB, 0, s0);
  CHECK(acl.bad_streams() > 0);
}

/* PyTorch's rule: record_stream on a tensor without memory (NULL) or with
 * memory another allocator made is ignored, quietly; gcalloc counts them. */
void foreign_memory_is_quiet() {
  Acl acl = start();
  TorchNpu t = with_object_hooks(FAKE_TORCH_NPU_PATH);
  void *mine = gca_npu_malloc(MiB, 0, t.stream_handle(0, 0)); /* (opens the allocator) */
  CHECK(mine);
  size_t before = gca_torch_foreign_stream_uses();
  std::vector<char> theirs(4096);
  CHECK(t.record_stream(nullptr, 0, 1) == 0);
  CHECK(t.record_stream(theirs.data(), 0, 1) == 0);
  CHECK(t.erase_stream(theirs.data(), 0, 1) == 0);
  CHECK(gca_torch_foreign_stream_uses() - before == 3);
  CHECK(errors_logged == 0);
  gca_npu_free(mine, MiB, 0, t.stream_handle(0, 0));
  (void)acl;
}

/* torch_npu's accessor throws (c10::Error) for a stream it does not know:
 * the exception crosses gcalloc's frames with nothing held, and every
 * next call works, on this thread and on another. */
void a_throwing_accessor_leaves_nothing_locked() {
  Acl acl = start();
  TorchNpu t = with_object_hooks(FAKE_TORCH_NPU_PATH);
  void *s0 = t.stream_handle(0, 0);
  void *p = gca_npu_malloc(MiB, 0, s0);
  CHECK(p);
  CHECK(t.record_stream(p, 0, 99) == -1);
  CHECK(strstr(t.failure(), "Unrecognized stream 99"));
  gca_npu_free(p, MiB, 0, s0);
  CHECK(active_bytes(0) == 0);
  std::thread other([&] {
    CHECK(acl.set_current(0) == 0);
    void *q = gca_npu_malloc(2 * MiB, 0, s0);
    CHECK(q);
    gca_npu_free(q, 2 * MiB, 0, s0);
    gca_torch_empty_cache();
  });
  other.join();
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
}

/* torch_npu's order is GIL -> allocator: its drain gives up the GIL while
 * it waits and takes it back. A "Python" thread allocating with the GIL
 * into the ladder (whose release drains the queue) and another freeing a
 * tensor with the GIL both finish: gcalloc holds no lock across the drain.
 * (With the device's lock held across it, the first waits for the GIL the
 * second holds while the second waits for the lock: a watchdog ends it.) */
void the_drain_and_the_gil() {
  Acl acl = start();
  TorchNpu t = load_torch_npu(FAKE_TORCH_NPU_PATH);
  acl.set_capacity(64 * MiB);
  CHECK(gca_npu_set_queue_drain(t.drain) == GCA_OK);
  alarm(30);
  void *s0 = t.stream_handle(0, 0);
  t.gil_acquire();
  void *kept = gca_npu_malloc(MiB, 0, s0); /* (the tensor the other thread frees) */
  void *p = gca_npu_malloc(40 * MiB, 0, s0);
  CHECK(kept && p);
  acl.queue_work((uintptr_t)p, 4096); /* (an operator on p, still in the host queue) */
  gca_npu_free(p, 40 * MiB, 0, s0);
  std::atomic<bool> freed{false};
  std::thread python([&] {
    CHECK(acl.set_current(0) == 0);
    t.gil_acquire(); /* (waits: the main thread holds it) */
    gca_npu_free(kept, MiB, 0, s0);
    freed = true;
    t.gil_release();
  });
  while (t.gil_waiting() == 0) std::this_thread::yield(); /* (the other thread waits for the GIL) */
  void *q = gca_npu_malloc(50 * MiB, 0, s0); /* 40 + 50 > 64: the ladder drains, then releases */
  CHECK(q);
  t.gil_release();
  python.join();
  CHECK(freed);
  CHECK(acl.stale_work() == 0); /* (the queued operator ran before its memory went back) */
  gca_npu_free(q, 50 * MiB, 0, s0);
  alarm(0);
}

/* The drain throws (a device error torch_npu raises even with check_error
 * false): the exception reaches the framework through gcalloc's frames,
 * which hold nothing then; the next allocation drains and works, on this
 * thread and on another, and the books are whole. */
void a_throwing_drain_leaves_nothing_locked() {
  Acl acl = start();
  TorchNpu t = load_torch_npu(FAKE_TORCH_NPU_PATH);
  acl.set_capacity(64 * MiB);
  CHECK(gca_npu_set_queue_drain(t.drain) == GCA_OK);
  void *s0 = t.stream_handle(0, 0);
  gca_npu_free(gca_npu_malloc(40 * MiB, 0, s0), 40 * MiB, 0, s0);
  t.throw_next_drain("NPU function error: task abort, error code is 107022");
  bool thrown = false;
  try {
    (void)gca_npu_malloc(50 * MiB, 0, s0);
  } catch (const std::exception &e) {
    thrown = strstr(e.what(), "107022") != nullptr;
  }
  CHECK(thrown);
  void *q = gca_npu_malloc(50 * MiB, 0, s0);
  CHECK(q);
  std::thread other([&] {
    CHECK(acl.set_current(0) == 0);
    void *r = gca_npu_malloc(MiB, 0, s0);
    CHECK(r);
    gca_npu_free(r, MiB, 0, s0);
  });
  other.join();
  gca_npu_free(q, 50 * MiB, 0, s0);
  gca_torch_empty_cache();
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
  CHECK(gca_reserved_bytes(gca_torch_allocator(), 0) == 0);
}

/* A drain that jumps out (longjmp) does the same. */
jmp_buf out_of_the_drain;
void jumping_drain(int device, void *user) {
  (void)device;
  if ((*(int *)user)++ == 0) longjmp(out_of_the_drain, 1);
}

void a_jumping_drain_leaves_nothing_locked() {
  Acl acl = start();
  acl.set_capacity(64 * MiB);
  void *p = gca_npu_malloc(40 * MiB, 0, nullptr);
  CHECK(p);
  static int runs; /* (static: read after the jump) */
  runs = 0;
  CHECK(gca_set_queue_drain(gca_torch_allocator(), jumping_drain, &runs) == GCA_OK);
  gca_npu_free(p, 40 * MiB, 0, nullptr);
  if (setjmp(out_of_the_drain) == 0) {
    (void)gca_npu_malloc(50 * MiB, 0, nullptr);
    CHECK(!"the drain did not jump");
  }
  CHECK(runs == 1);
  void *q = gca_npu_malloc(50 * MiB, 0, nullptr); /* (drained again: this time it returns) */
  CHECK(q && runs == 2);
  gca_npu_free(q, 50 * MiB, 0, nullptr);
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
}

/* torch_npu's operator workspaces hold device memory beside gcalloc: an
 * allocation the device cannot serve while they are cached succeeds once
 * the drop-in empties them (an OOM handler, with no lock held), through
 * whichever form of NPUWorkspaceAllocator::emptyCache the release has. */
void workspaces_give_way(const char *library, const char *symbol, int arity) {
  Acl acl = start();
  TorchNpu t = load_torch_npu(library);
  acl.set_capacity(64 * MiB);
  auto workspace = reinterpret_cast<void *(*)(int, size_t)>(dlsym(t.lib, "fake_torch_npu_workspace"));
  auto workspace_bytes = reinterpret_cast<size_t (*)(int)>(dlsym(t.lib, "fake_torch_npu_workspace_bytes"));
  void *release = dlsym(t.lib, symbol);
  CHECK(workspace && workspace_bytes && release);
  CHECK(workspace(0, 40 * MiB));
  CHECK(gca_npu_malloc(40 * MiB, 0, nullptr) == nullptr); /* (not connected: out of memory) */
  errors_logged = 0;
  CHECK(gca_npu_set_workspace_release(release, arity) == GCA_OK);
  void *p = gca_npu_malloc(40 * MiB, 0, nullptr);
  CHECK(p);
  CHECK(workspace_bytes(0) == 0);
  CHECK(errors_logged == 0);
  gca_npu_free(p, 40 * MiB, 0, nullptr);
  CHECK(gca_npu_set_workspace_release(release, 4) == GCA_ERR_INVALID);
  CHECK(gca_npu_set_workspace_release(nullptr, 0) == GCA_OK);
}

void workspaces_give_way_three_arguments() {
  workspaces_give_way(FAKE_TORCH_NPU_PATH, "_ZN7c10_npu21NPUWorkspaceAllocator10emptyCacheEibb", 3);
}

void workspaces_give_way_two_arguments() {
  workspaces_give_way(FAKE_TORCH_NPU_HANDLES_PATH, "_ZN7c10_npu21NPUWorkspaceAllocator10emptyCacheEib", 2);
}

/* ---- PyTorch's CUDA graphs through the pluggable allocator's hooks ----------
 * As torch/csrc/cuda/CUDAPluggableAllocator and Module.cpp have them: the
 * pool id a std::pair of two 64-bit integers, the begin hook's filter a
 * std::function passed by value, each hook held as std::function cast from
 * the address; CUDAGraph's capture_begin calls beginAllocateToPool, then
 * the driver's cuStreamBeginCapture (global mode); capture_end the
 * driver's end, then endAllocateToPool; reset releasePool. The driver is
 * the CUDA stand-in (fake_cuda.c). */
namespace c10::cuda {
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;
}  // namespace c10::cuda
typedef void *cudaStream_t;

namespace torch::cuda::CUDAPluggableAllocator {
struct CUDAPluggableAllocator {
  std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> begin_allocate_to_pool_fn_;
  std::function<void(int, c10::cuda::MempoolId_t)> end_allocate_to_pool_fn_, relase_pool_fn_;

  void beginAllocateToPool(int device, c10::cuda::MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
    if (begin_allocate_to_pool_fn_) begin_allocate_to_pool_fn_(device, id, std::move(filter));
  }
  void endAllocateToPool(int device, c10::cuda::MempoolId_t id) {
    if (end_allocate_to_pool_fn_) end_allocate_to_pool_fn_(device, id);
  }
  void releasePool(int device, c10::cuda::MempoolId_t id) {
    if (relase_pool_fn_) relase_pool_fn_(device, id);
  }
};
}  // namespace torch::cuda::CUDAPluggableAllocator

namespace cuda_pluggable = torch::cuda::CUDAPluggableAllocator;

/* PyTorch 2.1 and 2.2's pluggable allocator: the graph hooks name the
 * capturing stream (CUDAGraph's capture_begin calls
 * beginAllocateStreamToPool(device, stream, id), capture_end
 * endAllocateStreamToPool(device, stream) after the driver's end), and
 * Module.cpp's bindings set_begin_allocate_stream_to_pool,
 * set_end_allocate_stream_to_pool_fn, set_release_pool cast the addresses
 * to these types. */
struct CUDAPluggableAllocator22 {
  std::function<void(int, cudaStream_t, c10::cuda::MempoolId_t)> begin_allocate_stream_to_pool_fn_;
  std::function<void(int, cudaStream_t)> end_allocate_stream_to_pool_fn_;
  std::function<void(int, c10::cuda::MempoolId_t)> relase_pool_fn_;

  void beginAllocateStreamToPool(int device, cudaStream_t stream, c10::cuda::MempoolId_t id) {
    if (begin_allocate_stream_to_pool_fn_) begin_allocate_stream_to_pool_fn_(device, stream, id);
  }
  void endAllocateStreamToPool(int device, cudaStream_t stream) {
    if (end_allocate_stream_to_pool_fn_) end_allocate_stream_to_pool_fn_(device, stream);
  }
  void releasePool(int device, c10::cuda::MempoolId_t id) {
    if (relase_pool_fn_) relase_pool_fn_(device, id);
  }
};

void set_graph_hooks(CUDAPluggableAllocator22 &self, uint64_t begin, uint64_t end, uint64_t release) {
  using BeginType = void(int, cudaStream_t, c10::cuda::MempoolId_t);
  using EndType = void(int, cudaStream_t);
  using ReleaseType = void(int, c10::cuda::MempoolId_t);
  self.begin_allocate_stream_to_pool_fn_ = std::function<BeginType>(reinterpret_cast<BeginType *>(begin));
  self.end_allocate_stream_to_pool_fn_ = std::function<EndType>(reinterpret_cast<EndType *>(end));
  self.relase_pool_fn_ = std::function<ReleaseType>(reinterpret_cast<ReleaseType *>(release));
}

/* Module.cpp's bindings: set_begin_allocate_to_pool, set_end_allocate_to_pool_fn, set_release_pool. */
void set_graph_hooks(cuda_pluggable::CUDAPluggableAllocator &self, uint64_t begin, uint64_t end, uint64_t release) {
  using BeginType = void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>);
  using EndType = void(int, c10::cuda::MempoolId_t);
  std::function<BeginType> begin_fn = reinterpret_cast<BeginType *>(begin);
  std::function<EndType> end_fn = reinterpret_cast<EndType *>(end);
  std::function<EndType> release_fn = reinterpret_cast<EndType *>(release);
  self.begin_allocate_to_pool_fn_ = begin_fn;
  self.end_allocate_to_pool_fn_ = end_fn;
  self.relase_pool_fn_ = release_fn;
}

struct Driver {
  void *lib = nullptr;
  int (*stream_create)(uintptr_t *, unsigned) = nullptr;
  int (*begin_capture)(uintptr_t, int) = nullptr;
  int (*end_capture)(uintptr_t, void **) = nullptr;
  int (*capture_info)(uintptr_t, int *, uint64_t *) = nullptr;
  int (*retain)(void **, int) = nullptr;
  int (*set_current)(void *) = nullptr;
  int (*init)(unsigned) = nullptr;
};

/* The drop-in opened on the CUDA stand-in, the thread in device 0's context. */
Driver start_cuda() {
  Driver d;
  d.lib = dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
  CHECK(d.lib);
  find(d.lib, "cuStreamCreate", d.stream_create);
  find(d.lib, "cuStreamBeginCapture_v2", d.begin_capture);
  find(d.lib, "cuStreamEndCapture", d.end_capture);
  find(d.lib, "cuStreamGetCaptureInfo", d.capture_info);
  find(d.lib, "cuDevicePrimaryCtxRetain", d.retain);
  find(d.lib, "cuCtxSetCurrent", d.set_current);
  find(d.lib, "cuInit", d.init);
  CHECK(gca_torch_init("cuda:driver=" FAKE_CUDA_PATH, "") == GCA_OK);
  gca_set_log_handler(count_errors, nullptr);
  void *ctx = nullptr;
  CHECK(d.init(0) == 0 && d.retain(&ctx, 0) == 0 && d.set_current(ctx) == 0);
  return d;
}

/* CUDAGraph, as far as the allocator sees it. */
struct Graph {
  const Driver &driver;
  cuda_pluggable::CUDAPluggableAllocator &allocator;
  c10::cuda::MempoolId_t pool;
  uintptr_t stream;
  uint64_t capture_id = 0;

  void capture_begin() {
    allocator.beginAllocateToPool(0, pool, [this](cudaStream_t s) {
      int status = 0;
      uint64_t id = 0;
      driver.capture_info((uintptr_t)s, &status, &id);
      return status == 1 && id == capture_id;
    });
    CHECK(driver.begin_capture(stream, 0) == 0);
    int status = 0;
    CHECK(driver.capture_info(stream, &status, &capture_id) == 0 && status == 1);
  }
  void capture_end() {
    void *graph = nullptr;
    CHECK(driver.end_capture(stream, &graph) == 0);
    allocator.endAllocateToPool(0, pool);
  }
  void reset() { allocator.releasePool(0, pool); }
};

gca_pool_t pool_of(void *p) {
  gca_pool_t pool = 99;
  CHECK(gca_pool_of(gca_torch_allocator(), p, &pool) == GCA_OK);
  return pool;
}

int pools_on(int device) {
  gca_pool_t ids[8];
  return gca_pool_list(gca_torch_allocator(), device, ids, 8);
}

/* The capture's allocations go to the graph's private pool; what it frees
 * there is not handed out after the capture (the graph's replays still
 * write into it); another stream's allocation during the capture, and any
 * after it, come from the general cache; the pool ends, and its memory
 * goes back, once PyTorch releases it and its last block is freed. */
void graph_capture_uses_a_private_pool() {
  Driver driver = start_cuda();
  cuda_pluggable::CUDAPluggableAllocator allocator;
  set_graph_hooks(allocator, address(gca_torch_begin_allocate_to_pool), address(gca_torch_end_allocate_to_pool),
                  address(gca_torch_release_pool));
  uintptr_t s = 0, other = 0;
  CHECK(driver.stream_create(&s, 1) == 0 && driver.stream_create(&other, 1) == 0);
  Graph graph{driver, allocator, {1, 0}, s};
  graph.capture_begin();
  void *temp = gca_torch_malloc(4 * MiB, 0, (void *)s);
  void *output = gca_torch_malloc(2 * MiB, 0, (void *)s);
  void *elsewhere = gca_torch_malloc(4 * MiB, 0, (void *)other);
  CHECK(temp && output && elsewhere);
  CHECK(pool_of(temp) != 0 && pool_of(output) == pool_of(temp));
  CHECK(pool_of(elsewhere) == 0);
  gca_torch_free(temp, 4 * MiB, 0, (void *)s); /* (freed inside the graph: the pool's) */
  graph.capture_end();
  void *after = gca_torch_malloc(4 * MiB, 0, (void *)s);
  CHECK(after && after != temp && pool_of(after) == 0);
  CHECK(pools_on(0) == 1);
  graph.reset();
  CHECK(pools_on(0) == 1); /* (its output still lives) */
  gca_torch_free(output, 2 * MiB, 0, (void *)s);
  CHECK(pools_on(0) == 0);
  gca_torch_free(after, 4 * MiB, 0, (void *)s);
  gca_torch_free(elsewhere, 4 * MiB, 0, (void *)other);
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
  CHECK(errors_logged == 0);
}

/* The control: without the hooks (as before they were set), the capture's
 * memory comes from the general cache, and a block it freed is handed out
 * again after the capture while the graph's replays still write into it. */
void graph_capture_without_the_hooks_reuses_the_graphs_memory() {
  Driver driver = start_cuda();
  cuda_pluggable::CUDAPluggableAllocator allocator; /* (no hooks set) */
  uintptr_t s = 0;
  CHECK(driver.stream_create(&s, 1) == 0);
  Graph graph{driver, allocator, {1, 0}, s};
  graph.capture_begin();
  void *temp = gca_torch_malloc(4 * MiB, 0, (void *)s);
  CHECK(temp && pool_of(temp) == 0);
  gca_torch_free(temp, 4 * MiB, 0, (void *)s);
  graph.capture_end();
  void *after = gca_torch_malloc(4 * MiB, 0, (void *)s);
  CHECK(after == temp); /* (the hazard: the graph's memory given to a tensor) */
  gca_torch_free(after, 4 * MiB, 0, (void *)s);
}

/* Two graphs share a pool (graph.pool()): the second capture's allocations
 * go to the same pool; it ends when both are released. */
void graphs_sharing_a_pool() {
  Driver driver = start_cuda();
  cuda_pluggable::CUDAPluggableAllocator allocator;
  set_graph_hooks(allocator, address(gca_torch_begin_allocate_to_pool), address(gca_torch_end_allocate_to_pool),
                  address(gca_torch_release_pool));
  uintptr_t s = 0;
  CHECK(driver.stream_create(&s, 1) == 0);
  Graph first{driver, allocator, {7, 0}, s}, second{driver, allocator, {7, 0}, s};
  first.capture_begin();
  void *a = gca_torch_malloc(MiB, 0, (void *)s);
  first.capture_end();
  second.capture_begin();
  void *b = gca_torch_malloc(MiB, 0, (void *)s);
  second.capture_end();
  CHECK(pool_of(a) != 0 && pool_of(a) == pool_of(b));
  gca_torch_free(a, MiB, 0, (void *)s);
  gca_torch_free(b, MiB, 0, (void *)s);
  first.reset();
  CHECK(pools_on(0) == 1);
  second.reset();
  CHECK(pools_on(0) == 0);
}

/* PyTorch's error classes as its bindings tell them apart (c10::Error,
 * and c10::OutOfMemoryError derived from it), and raisers with
 * torchCheckFail's signature that throw them. */
struct CheckError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct OutOfMemoryError : CheckError {
  using CheckError::CheckError;
};
extern "C" void throw_check_error(const char *, const char *, uint32_t, const char *msg) { throw CheckError(msg); }
extern "C" void throw_out_of_memory(const char *, const char *, uint32_t, const char *msg) {
  throw OutOfMemoryError(msg);
}

/* What a refused allocation throws: which class, and its message. */
std::pair<std::string, std::string> refusal(ptrdiff_t size) {
  try {
    void *p = gca_torch_malloc(size, 0, nullptr);
    gca_torch_free(p, size, 0, nullptr);
    return {"none", ""};
  } catch (const OutOfMemoryError &e) {
    return {"OutOfMemoryError", e.what()};
  } catch (const CheckError &e) {
    return {"Error", e.what()};
  }
}

/* Out of memory goes to the out-of-memory raiser, every other refusal (and
 * out of memory without that raiser) to the general one; each exception
 * unwinds through gcalloc's frames with nothing left locked. */
void refusals_throw_the_frameworks_classes() {
  CHECK(gca_torch_init("sim:capacity=64MiB", nullptr) == GCA_OK);
  gca_torch_set_raise(reinterpret_cast<void *>(&throw_check_error));
  gca_torch_set_raise_oom(reinterpret_cast<void *>(&throw_out_of_memory));
  auto oom = refusal(256 * MiB);
  CHECK(oom.first == "OutOfMemoryError" && oom.second.find("gcalloc: CUDA out of memory. Tried to allocate") == 0);
  auto huge = refusal(-4096); /* (2^64 - 4096 bytes, arriving negative) */
  CHECK(huge.first == "Error" && huge.second.find("more than any device holds") != std::string::npos);
  gca_torch_set_raise_oom(nullptr);
  CHECK(refusal(256 * MiB).first == "Error");
  void *p = gca_torch_malloc(MiB, 0, nullptr); /* (the device's lock is free) */
  CHECK(p != nullptr);
  gca_torch_free(p, MiB, 0, nullptr);
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
  gca_torch_set_raise(nullptr);
}

/* PyTorch 2.1-2.2's form: the named stream's allocations go to the pool,
 * a stream outside the capture's do not; two captures at once each get
 * their own pool, though the later begin is the newer; each pool ends once
 * released and its blocks freed. */
void graph_capture_naming_its_stream() {
  Driver driver = start_cuda();
  CUDAPluggableAllocator22 allocator;
  set_graph_hooks(allocator, address(gca_torch_begin_allocate_stream_to_pool),
                  address(gca_torch_end_allocate_stream_to_pool), address(gca_torch_release_pool));
  uintptr_t s1 = 0, s2 = 0, other = 0;
  CHECK(driver.stream_create(&s1, 1) == 0 && driver.stream_create(&s2, 1) == 0 &&
        driver.stream_create(&other, 1) == 0);
  allocator.beginAllocateStreamToPool(0, (cudaStream_t)s1, {5, 0});
  CHECK(driver.begin_capture(s1, 0) == 0);
  allocator.beginAllocateStreamToPool(0, (cudaStream_t)s2, {6, 0});
  CHECK(driver.begin_capture(s2, 0) == 0);
  void *first = gca_torch_malloc(4 * MiB, 0, (void *)s1);
  void *second = gca_torch_malloc(4 * MiB, 0, (void *)s2);
  void *elsewhere = gca_torch_malloc(4 * MiB, 0, (void *)other);
  CHECK(first && second && elsewhere);
  CHECK(pool_of(first) != 0 && pool_of(second) != 0 && pool_of(first) != pool_of(second));
  CHECK(pool_of(elsewhere) == 0);
  gca_torch_free(first, 4 * MiB, 0, (void *)s1); /* (freed inside the graph: its pool's) */
  void *graph_end = nullptr;
  CHECK(driver.end_capture(s1, &graph_end) == 0 && driver.end_capture(s2, &graph_end) == 0);
  allocator.endAllocateStreamToPool(0, (cudaStream_t)s1);
  allocator.endAllocateStreamToPool(0, (cudaStream_t)s2);
  void *after = gca_torch_malloc(4 * MiB, 0, (void *)s1);
  CHECK(after && after != first && pool_of(after) == 0);
  CHECK(pools_on(0) == 2);
  allocator.releasePool(0, {5, 0});
  CHECK(pools_on(0) == 1);
  allocator.releasePool(0, {6, 0});
  CHECK(pools_on(0) == 1); /* (its block still lives) */
  gca_torch_free(second, 4 * MiB, 0, (void *)s2);
  CHECK(pools_on(0) == 0);
  gca_torch_free(after, 4 * MiB, 0, (void *)s1);
  gca_torch_free(elsewhere, 4 * MiB, 0, (void *)other);
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
  CHECK(errors_logged == 0);
}

/* The framework's queued work, run by its drain, frees a tensor while a
 * released graph's pool waits for its last block: the drain runs where
 * gcalloc holds no lock, so the free inside it goes through (it hung when
 * the pool's end drained under the drop-in's own lock). */
void *freed_by_the_drain;
void drain_freeing(int, void *) {
  void *p = std::exchange(freed_by_the_drain, nullptr);
  if (p) gca_torch_free(p, MiB, 0, nullptr);
}

void graph_pool_ends_with_the_drain_outside_every_lock() {
  CHECK(gca_torch_init("sim:capacity=256MiB", nullptr) == GCA_OK);
  CHECK(gca_set_queue_drain(gca_torch_allocator(), drain_freeing, nullptr) == GCA_OK);
  alarm(30); /* (a hang fails the case) */
  void *s = reinterpret_cast<void *>(0x100);
  gca_torch_begin_allocate_stream_to_pool(0, s, 4, 0);
  void *in_graph = gca_torch_malloc(MiB, 0, s);
  void *output = gca_torch_malloc(MiB, 0, s);
  gca_torch_end_allocate_stream_to_pool(0, s);
  CHECK(in_graph && output && pool_of(output) != 0);
  void *outside = gca_torch_malloc(MiB, 0, nullptr);
  CHECK(outside && pool_of(outside) == 0);
  gca_torch_free(in_graph, MiB, 0, s);
  gca_torch_release_pool(0, 4, 0);
  CHECK(pools_on(0) == 1); /* (its output still lives) */
  freed_by_the_drain = outside;
  gca_torch_free(output, MiB, 0, s); /* the pool ends: its memory goes back after a drain */
  CHECK(freed_by_the_drain == nullptr && pools_on(0) == 0);
  alarm(0);
  CHECK(gca_set_queue_drain(gca_torch_allocator(), nullptr, nullptr) == GCA_OK);
  CHECK(gca_check(gca_torch_allocator(), 0) == GCA_OK);
}

struct Case {
  const char *name;
  void (*run)();
};

const Case cases[] = {
    {"object_hooks_with_object_releases", object_hooks_with_object_releases},
    {"handle_hooks_with_handle_releases", handle_hooks_with_handle_releases},
    {"handle_hook_under_an_object_release_is_caught", handle_hook_under_an_object_release_is_caught},
    {"foreign_memory_is_quiet", foreign_memory_is_quiet},
    {"a_throwing_accessor_leaves_nothing_locked", a_throwing_accessor_leaves_nothing_locked},
    {"the_drain_and_the_gil", the_drain_and_the_gil},
    {"a_throwing_drain_leaves_nothing_locked", a_throwing_drain_leaves_nothing_locked},
    {"a_jumping_drain_leaves_nothing_locked", a_jumping_drain_leaves_nothing_locked},
    {"workspaces_give_way_three_arguments", workspaces_give_way_three_arguments},
    {"workspaces_give_way_two_arguments", workspaces_give_way_two_arguments},
    {"graph_capture_uses_a_private_pool", graph_capture_uses_a_private_pool},
    {"graph_capture_without_the_hooks_reuses_the_graphs_memory",
     graph_capture_without_the_hooks_reuses_the_graphs_memory},
    {"graphs_sharing_a_pool", graphs_sharing_a_pool},
    {"graph_capture_naming_its_stream", graph_capture_naming_its_stream},
    {"refusals_throw_the_frameworks_classes", refusals_throw_the_frameworks_classes},
    {"graph_pool_ends_with_the_drain_outside_every_lock", graph_pool_ends_with_the_drain_outside_every_lock},
};
}  // namespace

int main() {
  int failed = 0;
  for (const Case &c : cases) {
    fflush(nullptr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      c.run();
      gca_torch_shutdown();
      _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("[ %s ] %s\n", ok ? "  OK  " : "FAILED", c.name);
    failed += !ok;
  }
  printf("%d of %zu failed\n", failed, sizeof cases / sizeof cases[0]);
  return failed ? 1 : 0;
}
