/* A program built against an installed gcalloc, the way a user would. */
#include <gcalloc.h>
#include <stdio.h>

int main(void) {
  gca_allocator_t *a;
  if (gca_open("sim:capacity=1GiB", NULL, &a) != GCA_OK) {
    fprintf(stderr, "%s\n", gca_last_error());
    return 1;
  }
  void *p = gca_malloc(a, 1000, 0, 0);
  int ok = p != NULL && gca_allocated_bytes(a, 0) == 1024 && gca_free(a, p) == GCA_OK;
  gca_close(a);
  printf("consumer: gcalloc %s %s\n", gca_version(), ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
