/* How fast can two ranks of one node allreduce (sum, in place) float arrays, by what
 * path their memory allows? The data movement alone, no protocol: plain C, two processes
 * (fork), a spinning barrier in shared memory, the three paths interleaved per round,
 * best round per path and size.
 *
 *   cc -O3 -o target/allreduce_bounds benches/compare/allreduce_bounds.c
 *   target/allreduce_bounds [ROUNDS]
 *
 * Paths, rank r reducing half r:
 *   slots: each rank's array is its own (private memory): it copies the half its peer
 *          reduces into a shared slot; barrier; it adds the peer's slot into its half and
 *          publishes that half in its slot; barrier; it copies the peer's half out of the
 *          peer's slot (mpiflow's shared-memory allreduce of plain arrays);
 *   cma:   private arrays, single copy: the peer's half r is read into a cache-sized
 *          buffer by process_vm_readv and added into its own half; barrier; the peer's
 *          reduced half is read into its own array (Open MPI's vader with CMA);
 *   symmetric: both arrays in memory both map: each rank adds the two halves r and writes
 *          the sum into both arrays (mpiflow.symmetric).
 * Prints microseconds per call, one line per size.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (64 * 1024)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static _Atomic long *arrived;
static long gen;

static void barrier(void) {
  gen++;
  atomic_fetch_add(arrived, 1);
  while (atomic_load(arrived) < 2 * gen) {
  }
}

static void add(float *acc, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] += x[i];
}

static void *shared(size_t bytes) {
  void *p = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(1); }
  memset(p, 0, bytes);
  return p;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 20;
  size_t sizes[] = {1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24};
  size_t max = 1 << 24;
  arrived = shared(4096);
  float *slot[2] = {shared(max), shared(max)};
  float *sym[2] = {shared(max), shared(max)};
  float *mine = aligned_alloc(4096, max); /* the same address in both processes */
  memset(mine, 0, max);
  float *tmp = aligned_alloc(64, CHUNK);
  pid_t pids[2] = {getpid(), 0};
  _Atomic pid_t *child_pid = (void *)((char *)arrived + 64);
  pid_t child = fork();
  int me = child == 0;
  if (me) *child_pid = getpid();
  barrier();
  pids[1] = *child_pid;
  pid_t peer = pids[1 - me];
  for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
    size_t S = sizes[k], h = S / 2, n2 = h / 4;
    double best[3] = {1e9, 1e9, 1e9};
    for (int round = 0; round < rounds; round++) {
      for (int path = 0; path < 3; path++) {
        barrier();
        double t = now();
        char *my_half = (char *)mine + me * h, *other_half = (char *)mine + (1 - me) * h;
        if (path == 0) {
          memcpy((char *)slot[me] + (1 - me) * h, other_half, h);
          barrier();
          add((float *)my_half, (float *)((char *)slot[1 - me] + me * h), n2);
          memcpy((char *)slot[me] + me * h, my_half, h);
          barrier();
          memcpy(other_half, (char *)slot[1 - me] + (1 - me) * h, h);
        } else if (path == 1) {
          for (size_t off = 0; off < h; off += CHUNK) {
            size_t l = h - off < CHUNK ? h - off : CHUNK;
            struct iovec local = {tmp, l}, remote = {my_half + off, l};
            if (process_vm_readv(peer, &local, 1, &remote, 1, 0) != (ssize_t)l) {
              perror("process_vm_readv");
              exit(1);
            }
            add((float *)(my_half + off), tmp, l / 4);
          }
          barrier();
          struct iovec local = {other_half, h}, remote = {other_half, h};
          if (process_vm_readv(peer, &local, 1, &remote, 1, 0) != (ssize_t)h) {
            perror("process_vm_readv");
            exit(1);
          }
        } else {
          float *a = (float *)((char *)sym[me] + me * h), *b = (float *)((char *)sym[1 - me] + me * h);
          for (size_t i = 0; i < n2; i++) {
            float v = a[i] + b[i];
            a[i] = v;
            b[i] = v;
          }
        }
        barrier();
        double dt = now() - t;
        if (dt < best[path]) best[path] = dt;
      }
    }
    if (!me)
      printf("{\"bytes\": %zu, \"slots_us\": %.1f, \"cma_us\": %.1f, \"symmetric_us\": %.1f}\n", S,
             best[0] * 1e6, best[1] * 1e6, best[2] * 1e6);
    fflush(stdout);
  }
  if (!me) wait(0);
  return 0;
}
