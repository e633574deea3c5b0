/* libbsd's red-black tree macros (header-only; nothing is linked), for the
 * free index and the sim's address map. Its tree.h marks generated helpers
 * with __unused, which only libbsd's overlay mode defines. */
#ifndef GCALLOC_TREE_H
#define GCALLOC_TREE_H

#ifndef __unused
#define __unused __attribute__((__unused__))
#endif
#include <bsd/sys/tree.h>

#endif /* GCALLOC_TREE_H */
