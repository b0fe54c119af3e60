/* Does a one-sided atomic complete while its target stays out of MPI?
 *
 *   mpicc -O2 -o /tmp/target_progress benches/rma/target_progress.c
 *   mpirun -np 3 --mca osc sm,pt2pt /tmp/target_progress sleep
 *   mpirun -np 3 --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
 *          --mca osc ucx /tmp/target_progress sleep
 *
 * Rank 0 owns a window of int64 counters and, for 3 s, does what its first argument
 * says between 100 us sleeps: `sleep` (nothing), `self` (an atomic on its own window),
 * `iprobe` (MPI_Iprobe), `test` (MPI_Test of a receive that never matches: Open MPI's
 * whole progress engine once) or `flush` (MPI_Win_flush_all). Every other rank times one
 * MPI_Fetch_and_op on rank 0, after a warm-up that opened the connection. Prints one line
 * per other rank: how long the atomic took. 3.000 s means it waited for rank 0 to enter
 * MPI for good. Used by benches/results/2026-11-24-ucx.md and src/transport/progress.rs.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void fetch_add(int64_t v, int64_t *old, MPI_Win win) {
  MPI_Fetch_and_op(&v, old, MPI_INT64_T, 0, 0, MPI_SUM, win);
  MPI_Win_flush(0, win);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  const char *mode = argc > 1 ? argv[1] : "sleep";
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int64_t *base, old;
  MPI_Win win;
  MPI_Win_allocate(rank == 0 ? 64 : 0, 8, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
  if (rank == 0) base[0] = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
  if (rank != 0) fetch_add(0, &old, win); /* warm-up: connection established */
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  if (rank == 0) {
    MPI_Comm self;
    MPI_Request never;
    MPI_Comm_dup(MPI_COMM_SELF, &self);
    MPI_Irecv(NULL, 0, MPI_BYTE, 0, 0, self, &never);
    while (MPI_Wtime() - t0 < 3.0) {
      int flag;
      if (!strcmp(mode, "self")) fetch_add(0, &old, win);
      if (!strcmp(mode, "iprobe"))
        MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
      if (!strcmp(mode, "test")) MPI_Test(&never, &flag, MPI_STATUS_IGNORE);
      if (!strcmp(mode, "flush")) MPI_Win_flush_all(win);
      usleep(100);
    }
    MPI_Cancel(&never);
    MPI_Wait(&never, MPI_STATUS_IGNORE);
    MPI_Comm_free(&self);
  } else {
    fetch_add(1, &old, win);
    printf("rank %d: MPI_Fetch_and_op on rank 0 (%s) took %.3f s\n", rank, mode,
           MPI_Wtime() - t0);
  }
  MPI_Win_unlock_all(win);
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Win_free(&win);
  MPI_Finalize();
  return 0;
}
