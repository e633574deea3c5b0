/* A stand-in for torch_npu's C++ library (libtorch_npu.so), in C++ as
 * torch_npu is, with the shapes of the types and calls gcalloc meets:
 *
 * - c10_npu::NPUStream around a c10::Stream, with a user-provided
 *   destructor: under the Itanium C++ ABI an argument of its type is passed
 *   by invisible reference (the address of a temporary of the caller's);
 *   `aclrtStream NPUStream::stream(bool need_empty) const` reads its
 *   runtime stream (symbol _ZNK7c10_npu9NPUStream6streamEb), and throws, as
 *   torch_npu's AT_ASSERT does, for a stream id it does not know.
 * - NPUPluggableAllocator's record- and erase-stream hooks, held as
 *   std::function and set from an address cast exactly as Module.cpp casts
 *   it: to void(void *, c10_npu::NPUStream) in the torch_npu releases whose
 *   setter takes that (this library's default), to void(void *,
 *   aclrtStream) in those whose setter takes a stream handle (built with
 *   FAKE_TORCH_NPU_STREAM_HANDLES: the NPUStream is then converted, through
 *   its `operator aclrtStream`, at the call). The setters are exported
 *   under their mangled names, as in torch_npu, so a loader can tell which.
 * - c10_npu::NPUWorkspaceAllocator: operator workspaces, one cached block a
 *   device here (a stream in torch_npu), from the runtime directly, beside
 *   the pluggable allocator, kept until its emptyCache, which takes (int
 *   device, bool need_empty_queue, bool check_error) in this library's
 *   default form and (int device, bool check_error) in the older one.
 * - c10_npu::npuSynchronizeDevice(bool), the task queue's drain: it empties
 *   the AscendCL stand-in's queue (GCALLOC_ACL_LIBRARY) and synchronizes the
 *   thread's device. As torch_npu's once an aclop operator has run, it
 *   gives up the GIL while it waits and takes it back after (the GIL is a
 *   mutex here, taken by the tests' "Python" threads); and it throws
 *   c10::Error for a device error even with check_error false, as
 *   NPUException.cpp's errors with a specific message do
 *   (fake_torch_npu_throw_next_drain).
 *
 * Its streams are the AscendCL stand-in's, made with aclrtCreateStream (8
 * per device, ids 0-7, as torch_npu's pool), and the stand-in is told to
 * refuse any other handle (fakeacl_strict_streams). The extern "C"
 * functions at the end are what the Python stand-in and the C++ tests call
 * where torch_npu's Python bindings and its C++ callers (HCCL's process
 * groups) would. The tests put it at <stand-in torch_npu>/lib/. */
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#define EXPORT __attribute__((visibility("default")))

typedef void *aclrtStream;

namespace c10 {
enum class DeviceType : int8_t { CPU = 0, CUDA = 1, PrivateUse1 = 20 };
using DeviceIndex = int8_t;
using StreamId = int64_t;

struct Device {
  DeviceType type;
  DeviceIndex index;
};

class Stream {
 public:
  Stream(Device device, StreamId id) : device_(device), id_(id) {}
  DeviceIndex device_index() const { return device_.index; }
  DeviceType device_type() const { return device_.type; }
  StreamId id() const { return id_; }

 private:
  Device device_;
  StreamId id_;
};

/* A tensor's data pointer; the allocator's hooks get ptr.get(). */
class DataPtr {
 public:
  explicit DataPtr(void *ptr) : ptr_(ptr) {}
  ~DataPtr() {}
  void *get() const { return ptr_; }

 private:
  void *ptr_;
};

/* c10::Error, as TORCH_CHECK and AT_ASSERT throw it. */
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string &what) : std::runtime_error(what) {}
};
}  // namespace c10

namespace {
constexpr int kDevices = 8, kStreamsPerDevice = 8;
aclrtStream handles[kDevices][kStreamsPerDevice];
unsigned long drains;

/* Python's GIL, as far as the drain meets it. */
std::mutex gil;
thread_local bool holds_gil;
std::atomic<int> gil_waiting{0};        /* threads waiting for the GIL */
std::atomic<unsigned long> gil_taken{0}; /* times it was taken */
std::string throw_next; /* the next drain throws c10::Error with this message (empty: none) */
std::mutex throw_lock;

void *acl_library() {
  const char *path = getenv("GCALLOC_ACL_LIBRARY");
  void *acl = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (!acl) throw c10::Error("fake torch_npu: no AscendCL stand-in (GCALLOC_ACL_LIBRARY)");
  return acl;
}

/* torch_npu's stream pool: created on first use, on the stand-in runtime,
 * which from then on refuses handles it did not make. */
aclrtStream stream_handle(const c10::Stream &s) {
  int device = s.device_index();
  c10::StreamId id = s.id();
  if (s.device_type() != c10::DeviceType::PrivateUse1 || device < 0 || device >= kDevices || id < 0 ||
      id >= kStreamsPerDevice)
    throw c10::Error("Unrecognized stream " + std::to_string(id) + " on device " + std::to_string(device) +
                     " (something has gone horribly wrong!)");
  if (!handles[device][id]) {
    void *acl = acl_library();
    auto create = reinterpret_cast<int (*)(void **)>(dlsym(acl, "aclrtCreateStream"));
    auto strict = reinterpret_cast<void (*)(int)>(dlsym(acl, "fakeacl_strict_streams"));
    aclrtStream made = nullptr;
    int rc = create ? create(&made) : -1;
    if (rc != 0) throw c10::Error("aclrtCreateStream failed: " + std::to_string(rc));
    if (strict) strict(1);
    handles[device][id] = made;
    dlclose(acl);
  }
  return handles[device][id];
}
}  // namespace

namespace c10_npu {
class EXPORT NPUStream {
 public:
  explicit NPUStream(c10::Stream stream) : stream_(stream) {}
  ~NPUStream() {}  // user-provided, as torch_npu's: the type is passed by invisible reference

  /* Implicit conversion to the runtime's stream (empties the task queue first). */
  operator aclrtStream() const { return stream(); }
  aclrtStream stream() const;
  aclrtStream stream(const bool need_empty) const;
  c10::DeviceIndex device_index() const { return stream_.device_index(); }

 private:
  c10::Stream stream_;
};

EXPORT bool npuSynchronizeDevice(bool check_error);

aclrtStream NPUStream::stream() const {
  (void)npuSynchronizeDevice(false);
  return stream(false);
}

aclrtStream NPUStream::stream(const bool need_empty) const {
  if (need_empty) return stream();
  return stream_handle(stream_);
}

bool npuSynchronizeDevice(bool check_error) {
  (void)check_error;
  {
    std::lock_guard<std::mutex> guard(throw_lock);
    if (!throw_next.empty()) {
      std::string what = throw_next;
      throw_next.clear();
      throw c10::Error(what);
    }
  }
  /* The GIL is given up while the queue empties and the device
   * synchronizes, and taken back after. */
  bool had_gil = holds_gil;
  if (had_gil) {
    holds_gil = false;
    unsigned long taken = gil_taken;
    gil.unlock();
    /* (The device takes its time: a thread waiting for the GIL gets it
     * meanwhile, as it would while the NPU synchronizes.) */
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (gil_waiting > 0 && gil_taken == taken && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  struct Retake {
    bool had;
    ~Retake() {
      if (had) {
        gil.lock();
        holds_gil = true;
      }
    }
  } retake{had_gil};
  void *acl = nullptr;
  try {
    acl = acl_library();
  } catch (const c10::Error &e) {
    fprintf(stderr, "%s\n", e.what());
    return false;
  }
  auto run_queue = reinterpret_cast<void (*)()>(dlsym(acl, "fakeacl_run_queue"));
  auto synchronize = reinterpret_cast<int (*)()>(dlsym(acl, "aclrtSynchronizeDevice"));
  drains++;
  if (run_queue) run_queue();
  bool ok = synchronize && synchronize() == 0;
  dlclose(acl);
  return ok;
}
}  // namespace c10_npu

namespace c10_npu::NPUWorkspaceAllocator {
namespace {
void *workspace[kDevices];
size_t workspace_size[kDevices];

void free_workspace(int device) {
  if (device < 0 || device >= kDevices || !workspace[device]) return;
  void *acl = acl_library();
  auto release = reinterpret_cast<int (*)(void *)>(dlsym(acl, "aclrtFree"));
  if (!release || release(workspace[device]) != 0) throw c10::Error("aclrtFree of a workspace failed");
  workspace[device] = nullptr;
  workspace_size[device] = 0;
  dlclose(acl);
}
}  // namespace

#ifdef FAKE_TORCH_NPU_STREAM_HANDLES
EXPORT void emptyCache(int device, bool check_error) {
  (void)check_error;
  free_workspace(device);
}
#else
EXPORT void emptyCache(int device, bool need_empty_queue, bool check_error) {
  if (need_empty_queue) (void)npuSynchronizeDevice(check_error);
  free_workspace(device);
}
#endif

/* A workspace of at least `size` bytes on the thread's device `device`, as
 * torch_npu's malloc: the cached block, or a larger one in its place. */
void *workspace_for(int device, size_t size) {
  if (workspace_size[device] >= size) return workspace[device];
  free_workspace(device);
  void *acl = acl_library();
  auto allocate = reinterpret_cast<int (*)(void **, size_t, int)>(dlsym(acl, "aclrtMalloc"));
  void *p = nullptr;
  int rc = allocate ? allocate(&p, size, 0) : -1;
  dlclose(acl);
  if (rc != 0) return nullptr;
  workspace[device] = p;
  workspace_size[device] = size;
  return p;
}
}  // namespace c10_npu::NPUWorkspaceAllocator

namespace torch::npu::NPUPluggableAllocator {
#ifdef FAKE_TORCH_NPU_STREAM_HANDLES
using StreamHook = void(void *ptr, aclrtStream stream);
#else
using StreamHook = void(void *ptr, c10_npu::NPUStream stream);
#endif

struct EXPORT NPUPluggableAllocator {
  void set_record_stream_fn(std::function<StreamHook> record_stream_fn);
  void set_erase_stream_fn(std::function<StreamHook> erase_stream_fn);
  void recordStream(const c10::DataPtr &ptr, c10_npu::NPUStream stream);
  void eraseStream(const c10::DataPtr &ptr, c10_npu::NPUStream stream);

  std::function<StreamHook> record_stream_fn_, erase_stream_fn_;
};

void NPUPluggableAllocator::set_record_stream_fn(std::function<StreamHook> record_stream_fn) {
  record_stream_fn_ = std::move(record_stream_fn);
}

void NPUPluggableAllocator::set_erase_stream_fn(std::function<StreamHook> erase_stream_fn) {
  erase_stream_fn_ = std::move(erase_stream_fn);
}

/* As torch_npu's: the hook called with the stream object (converted at the
 * call where the hook takes a handle). */
void NPUPluggableAllocator::recordStream(const c10::DataPtr &ptr, c10_npu::NPUStream stream) {
  if (record_stream_fn_) record_stream_fn_(ptr.get(), stream);
}

void NPUPluggableAllocator::eraseStream(const c10::DataPtr &ptr, c10_npu::NPUStream stream) {
  if (erase_stream_fn_) erase_stream_fn_(ptr.get(), stream);
}

NPUPluggableAllocator current;
}  // namespace torch::npu::NPUPluggableAllocator

namespace {
namespace pluggable = torch::npu::NPUPluggableAllocator;

c10_npu::NPUStream npu_stream(int device, int64_t id) {
  return c10_npu::NPUStream(c10::Stream(c10::Device{c10::DeviceType::PrivateUse1, (c10::DeviceIndex)device}, id));
}

/* A C++ exception stops at the boundary: its message for the caller. */
char failure[512];

int caught(const std::exception &e) {
  snprintf(failure, sizeof failure, "%s", e.what());
  return -1;
}
}  // namespace

extern "C" {
/* Module.cpp's set_record_stream_fn / set_erase_stream_fn bindings: the
 * address cast to the hook's function type, held as std::function. */
EXPORT int fake_torch_npu_set_stream_hook(const char *setter, uint64_t func_ptr) {
  using FuncType = pluggable::StreamHook;
  std::function<FuncType> func = reinterpret_cast<FuncType *>(func_ptr);
  if (!strcmp(setter, "set_record_stream_fn")) pluggable::current.set_record_stream_fn(func);
  else if (!strcmp(setter, "set_erase_stream_fn")) pluggable::current.set_erase_stream_fn(func);
  else return -1;
  return 0;
}

/* A record_stream (Tensor.record_stream, or HCCL's from C++) of the stream
 * `id` of `device`; -1 with fake_torch_npu_failure() where C++ threw. */
EXPORT int fake_torch_npu_record_stream(void *ptr, int device, int64_t id) {
  try {
    pluggable::current.recordStream(c10::DataPtr(ptr), npu_stream(device, id));
    return 0;
  } catch (const std::exception &e) {
    return caught(e);
  }
}

EXPORT int fake_torch_npu_erase_stream(void *ptr, int device, int64_t id) {
  try {
    pluggable::current.eraseStream(c10::DataPtr(ptr), npu_stream(device, id));
    return 0;
  } catch (const std::exception &e) {
    return caught(e);
  }
}

/* torch.npu.Stream.npu_stream: the runtime's handle of a stream (NULL, with
 * fake_torch_npu_failure(), for one torch_npu does not know). */
EXPORT void *fake_torch_npu_stream_handle(int device, int64_t id) {
  try {
    return npu_stream(device, id).stream(false);
  } catch (const std::exception &e) {
    caught(e);
    return nullptr;
  }
}

EXPORT const char *fake_torch_npu_failure(void) { return failure; }

EXPORT unsigned long fake_torch_npu_drains(void) { return drains; }

/* An operator's workspace of `size` bytes on `device` (NULL where the
 * runtime has no room), and the bytes the workspace cache holds there. */
EXPORT void *fake_torch_npu_workspace(int device, size_t size) {
  try {
    return c10_npu::NPUWorkspaceAllocator::workspace_for(device, size);
  } catch (const std::exception &e) {
    caught(e);
    return nullptr;
  }
}

EXPORT size_t fake_torch_npu_workspace_bytes(int device) {
  return c10_npu::NPUWorkspaceAllocator::workspace_size[device];
}

/* The GIL of the tests' "Python" threads. */
EXPORT void fake_torch_npu_gil_acquire(void) {
  gil_waiting++;
  gil.lock();
  gil_waiting--;
  gil_taken++;
  holds_gil = true;
}

EXPORT int fake_torch_npu_gil_waiting(void) { return gil_waiting; }

EXPORT void fake_torch_npu_gil_release(void) {
  holds_gil = false;
  gil.unlock();
}

EXPORT void fake_torch_npu_throw_next_drain(const char *message) {
  std::lock_guard<std::mutex> guard(throw_lock);
  throw_next = message ? message : "";
}
}
