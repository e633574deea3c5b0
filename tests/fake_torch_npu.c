/* A stand-in for torch_npu's C++ library (libtorch_npu.so) with the one
 * entry point gcalloc's drop-in looks up: c10_npu::npuSynchronizeDevice,
 * under its mangled name. As torch_npu's, it empties the task queue (here
 * the AscendCL stand-in's, named by GCALLOC_ACL_LIBRARY) and synchronizes
 * the thread's device. The tests put it at <stand-in torch_npu>/lib/. */
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#define EXPORT __attribute__((visibility("default")))

static unsigned long drains;

/* bool c10_npu::npuSynchronizeDevice(bool check_error) */
EXPORT bool _ZN7c10_npu20npuSynchronizeDeviceEb(bool check_error) {
  (void)check_error;
  const char *path = getenv("GCALLOC_ACL_LIBRARY");
  void *acl = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
  if (!acl) {
    fprintf(stderr, "fake torch_npu: no AscendCL stand-in (GCALLOC_ACL_LIBRARY)\n");
    return false;
  }
  void (*run_queue)(void) = (void (*)(void))dlsym(acl, "fakeacl_run_queue");
  int (*synchronize)(void) = (int (*)(void))dlsym(acl, "aclrtSynchronizeDevice");
  drains++;
  if (run_queue) run_queue();
  bool ok = synchronize && synchronize() == 0;
  dlclose(acl);
  return ok;
}

EXPORT unsigned long fake_torch_npu_drains(void) { return drains; }
