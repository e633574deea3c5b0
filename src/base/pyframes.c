/* The Python frames of the calling thread, for the history's stacks, found
 * through CPython's own functions in the running process (dlsym at first
 * use; nothing links libpython, and a process without Python finds none).
 *
 * Gathering takes the GIL (PyGILState_Ensure), so it is done before any
 * gcalloc lock is taken: the GIL is always acquired first, as PyTorch's
 * allocator does, and a thread that holds the GIL while it frees can never
 * wait on a thread that waits for the GIL while holding a device lock. A
 * thread with no Python thread state (one C made) gathers nothing.
 *
 * A frame is kept as its code object and line, packed in one word tagged
 * with the top bit (no user-space return address has it), so it travels
 * with the native return addresses of a stack. A code object is interned
 * once, with a reference that is never dropped (code objects live as long
 * as their functions, for most the whole run) and its file and qualified
 * name copied: a snapshot resolves frames without the GIL, from any
 * thread. The table is filled under the GIL; an index is read only after
 * the device lock has published the stack that holds it.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"

typedef struct py_object py_object_t; /* PyObject, PyFrameObject, PyThreadState: opaque here */

static struct {
  int (*is_initialized)(void);
  int (*is_finalizing)(void);            /* optional (_Py_IsFinalizing, Py_IsFinalizing) */
  py_object_t *(*this_thread_state)(void); /* PyGILState_GetThisThreadState */
  int (*ensure)(void);                   /* PyGILState_Ensure */
  void (*release)(int);                  /* PyGILState_Release */
  py_object_t *(*current_frame)(void);   /* PyEval_GetFrame: borrowed */
  py_object_t *(*frame_back)(py_object_t *);  /* PyFrame_GetBack: new reference */
  py_object_t *(*frame_code)(py_object_t *);  /* PyFrame_GetCode: new reference */
  int (*frame_line)(py_object_t *);      /* PyFrame_GetLineNumber */
  void (*decref)(py_object_t *);         /* Py_DecRef */
  py_object_t *(*getattr)(py_object_t *, const char *); /* PyObject_GetAttrString */
  const char *(*utf8)(py_object_t *);    /* PyUnicode_AsUTF8 */
  void (*error_clear)(void);             /* PyErr_Clear */
  bool ready;
} py;

static pthread_once_t py_once = PTHREAD_ONCE_INIT;

#define FIND(field, name) (*(void **)&py.field = dlsym(RTLD_DEFAULT, name))

static void py_find(void) {
  FIND(is_initialized, "Py_IsInitialized");
  if (!FIND(is_finalizing, "Py_IsFinalizing")) FIND(is_finalizing, "_Py_IsFinalizing");
  FIND(this_thread_state, "PyGILState_GetThisThreadState");
  FIND(ensure, "PyGILState_Ensure");
  FIND(release, "PyGILState_Release");
  FIND(current_frame, "PyEval_GetFrame");
  FIND(frame_back, "PyFrame_GetBack");
  FIND(frame_code, "PyFrame_GetCode");
  FIND(frame_line, "PyFrame_GetLineNumber");
  FIND(decref, "Py_DecRef");
  FIND(getattr, "PyObject_GetAttrString");
  FIND(utf8, "PyUnicode_AsUTF8");
  FIND(error_clear, "PyErr_Clear");
  py.ready = py.is_initialized && py.this_thread_state && py.ensure && py.release && py.current_frame &&
             py.frame_back && py.frame_code && py.frame_line && py.decref && py.getattr && py.utf8 && py.error_clear;
}

/* ---- interned code objects ---------------------------------------------- */

#define CODES_MAX 8192 /* distinct functions; past it, frames resolve to "??" */
#define CODE_UNKNOWN 0x7FFFFFFFu

typedef struct code_entry {
  const py_object_t *code;
  const char *file, *name;
} code_entry_t;

static code_entry_t codes[CODES_MAX];
static uint32_t code_slots[2 * CODES_MAX]; /* open addressing by pointer: index + 1, 0 empty */
static uint32_t code_count;

/* A copy of the string attribute `attr` of `obj`, or NULL (GIL held). */
static const char *attribute_text(py_object_t *obj, const char *attr) {
  py_object_t *value = py.getattr(obj, attr);
  if (!value) {
    py.error_clear();
    return NULL;
  }
  const char *text = py.utf8(value);
  char *copy = text ? strdup(text) : NULL;
  if (!text) py.error_clear();
  py.decref(value);
  return copy;
}

/* The index of `code` (a new reference, taken over), interning it (GIL held). */
static uint32_t intern_code(py_object_t *code) {
  size_t slot = ((uintptr_t)code * 0x9E3779B97F4A7C15ull >> 40) & (2 * CODES_MAX - 1);
  for (; code_slots[slot]; slot = (slot + 1) & (2 * CODES_MAX - 1)) {
    if (codes[code_slots[slot] - 1].code == code) {
      py.decref(code);
      return code_slots[slot] - 1;
    }
  }
  if (code_count == CODES_MAX) {
    py.decref(code);
    return CODE_UNKNOWN;
  }
  const char *name = attribute_text(code, "co_qualname"); /* (3.11 on) */
  if (!name) name = attribute_text(code, "co_name");
  code_entry_t *e = &codes[code_count];
  e->code = code; /* (the reference is kept: the pointer stays this code's) */
  e->file = attribute_text(code, "co_filename");
  e->name = name;
  code_slots[slot] = ++code_count;
  return code_count - 1;
}

/* ---- public ------------------------------------------------------------- */

bool gca__py_present(void) {
  pthread_once(&py_once, py_find);
  return py.ready && py.is_initialized();
}

size_t gca__py_gather(uintptr_t *out, size_t cap) {
  pthread_once(&py_once, py_find);
  if (!py.ready || !py.is_initialized() || (py.is_finalizing && py.is_finalizing()) || !py.this_thread_state())
    return 0;
  int state = py.ensure();
  size_t n = 0;
  py_object_t *frame = py.current_frame();
  bool owned = false;
  while (frame && n < cap) {
    int line = py.frame_line(frame);
    uint32_t code = intern_code(py.frame_code(frame));
    out[n++] = GCA_PY_FRAME_TAG | (uintptr_t)code << 32 | (uint32_t)(line < 0 ? 0 : line);
    py_object_t *back = py.frame_back(frame);
    if (owned) py.decref(frame);
    frame = back;
    owned = true;
  }
  if (owned && frame) py.decref(frame);
  py.release(state);
  return n;
}

bool gca__py_frame(uintptr_t tagged, const char **file, const char **name, int *line) {
  if (!(tagged & GCA_PY_FRAME_TAG)) return false;
  uint32_t code = (uint32_t)(tagged >> 32) & 0x7FFFFFFFu;
  const code_entry_t *e = code < CODES_MAX ? &codes[code] : NULL;
  *file = e && e->file ? e->file : "??";
  *name = e && e->name ? e->name : "??";
  *line = (int)(uint32_t)tagged;
  return true;
}
