/* What the regions that processes share (the shared sim device, the
 * cooperation rendezvous) need alike: opening or creating a POSIX
 * shared-memory object of a fixed size, a process-shared robust mutex that
 * the next locker repairs when its owner died, and whether a process is
 * still the one a slot names (pid and start time, so that a reused pid is
 * not taken for it).
 *
 * Liveness is asked often (every look at a shared device's free memory,
 * every request to the peers), and the proof by /proc costs an open and a
 * read of a file per process. So a process found alive that way (the pidfd
 * opened before the proof, so that it names the process proved) is kept
 * with a pidfd (pidfd_open(2), Linux 5.3), which names that one process
 * for good, whatever happens to its pid: later looks poll it, one system
 * call, readable once the process has ended (a zombie included, as the
 * proof by /proc counts it). Where pidfd_open is refused (an older kernel,
 * a seccomp filter, no descriptor left) the proof by /proc is taken each
 * time, as before.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"

/* (glibc names the system call only from 2.36 on; the kernel's headers do.) */
#if !defined(SYS_pidfd_open) && defined(__NR_pidfd_open)
#define SYS_pidfd_open __NR_pidfd_open
#endif

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

/* The proof by /proc: 1 when the pid's process is there, with the start
 * time recorded, and has not ended; 0 when it is not; -1 when its stat
 * cannot be read (/proc mounted hidepid, no file descriptor left), which is
 * no proof of death. A zombie has given its memory back: ended. */
static int alive_by_stat(int pid, uint64_t start_time) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
  char state;
  uint64_t now;
  if (!read_stat(pid, &state, &now)) return -1;
  return now == start_time && state != 'Z' && state != 'X';
}

/* The processes found alive, each with a pidfd naming it. The table's lock
 * is only ever tried, never waited for (a thread that finds it taken, or a
 * child forked while another thread held it, takes the proof by /proc),
 * so it can neither block nor deadlock; its rank is still checked. Each
 * entry keeps its descriptor's identity (device and inode), checked before
 * the descriptor is trusted or closed: a program that closed descriptors
 * it does not own (a daemon's close_range) may have reused the number. */
#define PIDFDS_KEPT 64
typedef struct {
  int pid; /* 0: free */
  int fd;
  uint64_t start_time;
  dev_t dev;
  ino_t ino;
} pidfd_entry_t;
static pidfd_entry_t pidfds[PIDFDS_KEPT];
static pthread_mutex_t pidfds_lock = PTHREAD_MUTEX_INITIALIZER;

static bool pidfds_try_lock(void) {
  if (pthread_mutex_trylock(&pidfds_lock) != 0) return false;
  LOCK_ORDER_TAKE(&pidfds_lock, RANK_PIDFDS, __FILE__, __LINE__, ORDER_WAITS);
  return true;
}

static void pidfds_unlock(void) { mutex_unlock(&pidfds_lock); }

static bool pidfd_is(const pidfd_entry_t *e) {
  struct stat st;
  return fstat(e->fd, &st) == 0 && st.st_dev == e->dev && st.st_ino == e->ino;
}

/* With the table's lock: the entry forgotten, its descriptor closed if it
 * is still the one opened. */
static void pidfd_forget(pidfd_entry_t *e) {
  if (pidfd_is(e)) close(e->fd);
  *e = (pidfd_entry_t){0};
}

/* 1: the process (pid, start_time) is alive, 0: it has ended, -1: not
 * known here. */
static int pidfd_known(int pid, uint64_t start_time) {
  if (!pidfds_try_lock()) return -1;
  int known = -1;
  for (int i = 0; i < PIDFDS_KEPT; i++) {
    pidfd_entry_t *e = &pidfds[i];
    if (e->pid != pid) continue;
    struct pollfd p = {e->fd, POLLIN, 0};
    if (!pidfd_is(e) || poll(&p, 1, 0) < 0 || (p.revents & POLLNVAL)) {
      pidfd_forget(e); /* (not ours any more: the proof by /proc decides) */
      break;
    }
    bool ended = (p.revents & (POLLIN | POLLHUP)) != 0;
    if (e->start_time == start_time) known = !ended;
    else if (!ended) known = 0; /* its pid is another process's now: the one asked about has ended */
    if (ended) pidfd_forget(e);
    break;
  }
  pidfds_unlock();
  return known;
}

/* A pidfd for whatever process has `pid` now; -1 where none can be had. */
static int pidfd_open_for(int pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0); /* (close-on-exec) */
#else
  (void)pid;
  return -1;
#endif
}

/* `fd`, a pidfd opened before /proc proved (pid, start_time) alive, so
 * that it names that process and not one that took its pid before the
 * proof: kept where a place is free, else closed. */
static void pidfd_keep(int pid, uint64_t start_time, int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !pidfds_try_lock()) {
    close(fd);
    return;
  }
  pidfd_entry_t *slot = NULL;
  for (int i = 0; i < PIDFDS_KEPT && !slot; i++) {
    if (pidfds[i].pid == pid) pidfd_forget(&pidfds[i]); /* (an earlier process of that pid) */
    if (!pidfds[i].pid) slot = &pidfds[i];
  }
  if (slot) *slot = (pidfd_entry_t){pid, fd, start_time, st.st_dev, st.st_ino};
  else close(fd);
  pidfds_unlock();
}

bool gca__process_alive(int pid, uint64_t start_time) {
  if (pid <= 0) return false;
  int known = pidfd_known(pid, start_time);
  if (known >= 0) return known;
  int fd = start_time ? pidfd_open_for(pid) : -1;
  int alive = alive_by_stat(pid, start_time);
  if (fd >= 0 && alive == 1) pidfd_keep(pid, start_time, fd);
  else if (fd >= 0) close(fd);
  return alive != 0;
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
  int rc = pthread_mutex_trylock(m); /* (free, the usual case: no clock to read) */
  if (rc == EBUSY && ns) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* (pthread_mutex_timedlock's clock) */
    uint64_t nsec = (uint64_t)until.tv_nsec + ns;
    until.tv_sec += (time_t)(nsec / 1000000000u);
    until.tv_nsec = (long)(nsec % 1000000000u);
    rc = pthread_mutex_timedlock(m, &until);
  }
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
