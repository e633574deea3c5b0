/* What the regions that processes share (the shared sim device, the
 * cooperation rendezvous) need alike: opening or creating a POSIX
 * shared-memory object of a fixed size, a process-shared robust mutex that
 * the next locker repairs when its owner died, and whether a process is
 * still the one a slot names (pid and start time, so that a reused pid is
 * not taken for it).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"

/* Field 3 (state) and field 22 (start time) of /proc/PID/stat; false when
 * it cannot be read. */
static bool read_stat(int pid, char *state, uint64_t *start_time) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return false;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *p = strrchr(buf, ')'); /* the command may hold spaces and parentheses */
  if (!p || p[1] != ' ' || !p[2]) return false;
  *state = p[2];
  for (int field = 2; field < 22 && p; field++) p = strchr(p + 1, ' ');
  if (!p) return false;
  *start_time = strtoull(p + 1, NULL, 10);
  return true;
}

uint64_t gca__process_start_time(int pid) {
  char state;
  uint64_t start_time;
  return read_stat(pid, &state, &start_time) ? start_time : 0;
}

uint64_t gca__pid_namespace(void) {
  static _Atomic uint64_t cached; /* (0: not read yet, or unreadable) */
  uint64_t ns = atomic_load_explicit(&cached, memory_order_relaxed);
  struct stat st;
  if (!ns && stat("/proc/self/ns/pid", &st) == 0) atomic_store(&cached, ns = (uint64_t)st.st_ino);
  return ns;
}

/* Liveness by lock: the kernel lets go of a dead process's file locks
 * whatever its pid namespace, so a lock byte per slot tells a dead member
 * from a live one where its pid means nothing (a container started with
 * --ipc=host). Open-file-description locks (F_OFD_*): a classic POSIX lock
 * would go whenever the process closed any descriptor of the file (a scan
 * by gcalloc top in the same process). A child of fork shares its parent's
 * description until it closes its copy; where the pid can be checked it is
 * checked too, so a parent that died while its child lives is still seen
 * dead. */
bool gca__slot_lock(int fd, int slot, bool on) {
  struct flock l = {.l_type = on ? F_WRLCK : F_UNLCK, .l_whence = SEEK_SET, .l_start = slot, .l_len = 1};
  return fd >= 0 && fcntl(fd, F_OFD_SETLK, &l) == 0;
}

int gca__slot_lock_held(int fd, int slot) {
  struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot, .l_len = 1};
  if (fd < 0 || fcntl(fd, F_OFD_GETLK, &l) != 0) return -1;
  return l.l_type != F_UNLCK;
}

bool gca__slot_alive(int fd, int slot, bool locked, int pid, uint64_t start_time, uint64_t pidns) {
  if (locked) {
    int held = gca__slot_lock_held(fd, slot);
    if (held == 0) return false; /* its lock is gone: so is it */
    uint64_t mine = gca__pid_namespace();
    if (held == 1 && pidns && mine && pidns != mine) return true;
  }
  return gca__slot_process_alive(pid, start_time, pidns);
}

bool gca__slot_process_alive(int pid, uint64_t start_time, uint64_t pidns) {
  uint64_t mine = gca__pid_namespace();
  if (pidns && mine && pidns != mine) return true; /* its pid means nothing here: its own namespace judges */
  return gca__process_alive(pid, start_time);
}

bool gca__process_alive(int pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  /* A zombie has given its memory back; a stat that cannot be read
   * (/proc mounted hidepid, no file descriptor left) is no proof of death. */
  char state;
  uint64_t now;
  if (!read_stat(pid, &state, &now)) return true;
  return now == start_time && state != 'Z' && state != 'X';
}

int gca__shared_mutex_init(pthread_mutex_t *m) {
  pthread_mutexattr_t attr;
  if (pthread_mutexattr_init(&attr) != 0) return -1;
  int rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED) ||
           pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST) || pthread_mutex_init(m, &attr);
  pthread_mutexattr_destroy(&attr);
  return rc ? -1 : 0;
}

void gca__shared_mutex_lock_at(pthread_mutex_t *m, int rank, const char *file, int line) {
  (void)rank;
  LOCK_ORDER_TAKE(m, rank, file, line, ORDER_WAITS);
  if (pthread_mutex_lock(m) == EOWNERDEAD) pthread_mutex_consistent(m);
}

bool gca__shared_mutex_lock_within_at(pthread_mutex_t *m, int rank, uint64_t ns, const char *file, int line) {
  (void)rank;
  LOCK_ORDER_TAKE(m, rank, file, line, ORDER_WAITS);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until); /* (pthread_mutex_timedlock's clock) */
  uint64_t nsec = (uint64_t)until.tv_nsec + ns;
  until.tv_sec += (time_t)(nsec / 1000000000u);
  until.tv_nsec = (long)(nsec % 1000000000u);
  int rc = pthread_mutex_timedlock(m, &until);
  if (rc == EOWNERDEAD) pthread_mutex_consistent(m);
  if (rc == 0 || rc == EOWNERDEAD) return true;
  LOCK_ORDER_DROP(m);
  return false;
}

void *gca__shared_region_open(const char *path, size_t size, unsigned mode, bool *created, int *fd_out) {
  *created = true;
  if (fd_out) *fd_out = -1;
  int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, (mode_t)mode);
  if (fd < 0 && errno == EEXIST) {
    *created = false;
    fd = shm_open(path, O_RDWR, (mode_t)mode);
  }
  if (fd < 0) {
    gca__set_error(GCA_ERR_BACKEND, "cannot open %s: %s", path, strerror(errno));
    return NULL;
  }
  struct stat st;
  if (*created) {
    (void)fchmod(fd, (mode_t)mode); /* (the umask may have taken the group's bits) */
    if (ftruncate(fd, (off_t)size) != 0) {
      gca__set_error(GCA_ERR_BACKEND, "cannot size %s: %s", path, strerror(errno));
      close(fd);
      shm_unlink(path);
      return NULL;
    }
  } else {
    /* Its creator sizes it at once: give it a moment. */
    for (int tries = 0; tries < 100 && fstat(fd, &st) == 0 && st.st_size == 0; tries++) {
      struct timespec pause = {0, 10 * 1000 * 1000};
      nanosleep(&pause, NULL);
    }
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != size) {
      gca__set_error(GCA_ERR_BACKEND, "%s is %lld bytes, not a gcalloc region of this kind (%zu)", path,
                     (long long)st.st_size, size);
      close(fd);
      return NULL;
    }
    /* Another user's region (one that someone made open to all, say) could
     * be held or rewritten by that user: only this user's, or with group
     * access asked for, this group's, with no more access than gcalloc
     * gives. */
    bool owner = st.st_uid == geteuid() || ((mode & 0070) && st.st_gid == getegid());
    if (!owner || (st.st_mode & 0777 & ~(mode_t)mode)) {
      if (!owner)
        gca__set_error(GCA_ERR_BACKEND, "%s belongs to uid %u, not to this user (uid %u)%s; remove it or use another "
                       "name", path, (unsigned)st.st_uid, (unsigned)geteuid(), mode & 0070 ? " nor to this group" : "");
      else
        gca__set_error(GCA_ERR_BACKEND, "%s has mode %03o, more than the %03o gcalloc gives it; remove it", path,
                       (unsigned)(st.st_mode & 0777), mode);
      close(fd);
      return NULL;
    }
  }
  void *r = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (fd_out && r != MAP_FAILED) *fd_out = fd; /* (close-on-exec: shm_open's) */
  else close(fd);
  if (r == MAP_FAILED) {
    gca__set_error(GCA_ERR_BACKEND, "cannot map %s: %s", path, strerror(errno));
    if (*created) shm_unlink(path);
    return NULL;
  }
  return r;
}

bool gca__shared_region_wait(_Atomic uint64_t *magic) {
  for (int tries = 0; tries < 100 && atomic_load(magic) == 0; tries++) {
    struct timespec pause = {0, 10 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  return atomic_load(magic) != 0;
}
