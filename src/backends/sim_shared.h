/* The sim's device shared by several processes (sim_shared.c): the
 * capacity and each process's holdings in shared memory. */
#ifndef GCALLOC_SIM_SHARED_H
#define GCALLOC_SIM_SHARED_H

#include <stdbool.h>
#include <stddef.h>

typedef struct sim_shared sim_shared_t;

/* Join (or create) the device NAME: `devices` devices of `capacity` bytes
 * each; a joiner takes the region's capacity (*capacity_out), and is
 * refused when it asked (capacity_given) for another, or another device
 * count. GCA_ERR_BACKEND naming the region when it cannot be had or is not
 * a gcalloc sim region. */
int gca__sim_shared_join(const char *name, size_t capacity, bool capacity_given, int devices, size_t *capacity_out,
                         sim_shared_t **out);
/* Unmap the region and free this process's handle, leaving the slot (and
 * what it holds) as it is: a child of fork, whose slot is its parent's. */
void gca__sim_shared_forget(sim_shared_t *sh);
/* In a child of fork, at once: close the child's copy of the region's file,
 * so that the parent's lock byte goes with the parent (gca__slot_alive). */
void gca__sim_shared_after_fork_child(sim_shared_t *sh);
void gca__sim_shared_leave(sim_shared_t *sh);
/* The region's path ("/gcalloc-sim-NAME"): what names the device. */
const char *gca__sim_shared_name(const sim_shared_t *sh);
/* Take `bytes` of `device` for this process: GCA_OK, or GCA_ERR_OOM when
 * the processes together would pass the capacity (dead ones' memory given
 * back first); *free_bytes is what is left either way. */
int gca__sim_shared_charge(sim_shared_t *sh, int device, size_t bytes, size_t *free_bytes);
void gca__sim_shared_release(sim_shared_t *sh, int device, size_t bytes);
/* The device's free bytes, all processes counted. */
size_t gca__sim_shared_free(sim_shared_t *sh, int device);

#endif /* GCALLOC_SIM_SHARED_H */
