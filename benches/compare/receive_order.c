/* How fast can a window of small messages arrive in one buffer, in plain MPI?
 *
 *   mpicc -O2 -o target/receive_order benches/compare/receive_order.c
 *   mpirun -np 2 target/receive_order [bw|bibw] [ROUNDS] [MAX_SIZE]
 *   mpicc.mpich -O2 -o target/receive_order_mpich benches/compare/receive_order.c   # MPICH
 *   mpiexec.mpich -n 2 target/receive_order_mpich bw 15 65536
 *   OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_tls=any OMPI_MCA_pml_ucx_devices=any \
 *     mpirun -np 2 target/receive_order bw 15 65536              # Open MPI on UCX
 *
 * osu_bw's default (`-b single`) has the receiver post its whole window of 64 receives
 * into ONE buffer, then wait for them all: several pending receives writing the same
 * memory. A tensor API whose receive borrows its tensor exclusively cannot do that; the
 * nearest it can do with one tensor is to receive the window one message at a time.
 * This program measures both orders in plain MPI, alternating in the same job, with
 * osu_bw's sender (a window of MPI_Isend from one buffer, MPI_Waitall, a 1-byte reply):
 *
 *   posted      the receiver posts 64 MPI_Irecv into one buffer, then MPI_Waitall (OSU)
 *   sequential  the receiver calls MPI_Recv 64 times into one buffer
 *   ahead       the receiver keeps 64 MPI_Irecv posted into 64 buffers of its own, posted
 *               before the first window; each message is an MPI_Wait on the oldest, then
 *               an MPI_Irecv into its buffer again (what mpiflow's inbox does, whose
 *               buffer exchange with the caller's tensor copies nothing); the receives
 *               still posted at the end are cancelled
 *
 * With `bibw`, both ranks send and receive a window as osu_bibw does (posted: receives
 * into one buffer, then sends, MPI_Waitall on each; sequential: the sends in flight,
 * then MPI_Recv 64 times, then MPI_Waitall on the sends), both directions counted.
 *
 * Per size it prints each order's best bandwidth over the rounds (MB/s, as osu_bw) and
 * the medians over rounds of the in-round ratios sequential/posted and ahead/posted: the
 * ceilings of a one-tensor receive relative to osu_bw, before any cost of the tensor API
 * itself. (`ahead` is measured with bw only.)
 * Used by benches/results/2026-11-25-osu.md, 2026-11-26-mpich.md and 2026-11-27-ucx.md.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WINDOW 64
#define MAX_ROUNDS 64

/* The buffers of the `ahead` order, WINDOW of the largest size. */
static char *slots;

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Seconds for `iters` windows of `size` bytes after `warmup` untimed ones. */
static double run(int me, int bibw, int order, char *sb, char *rb, int size, int iters,
                  int warmup) {
  MPI_Request req[WINDOW], sreq[WINDOW], ring[WINDOW];
  char ack = 0;
  double t0 = 0;
  int sequential = order == 1, ahead = order == 2 && !bibw, next = 0;
  if (ahead && me == 1)
    for (int j = 0; j < WINDOW; j++)
      MPI_Irecv(slots + (size_t)j * size, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD, &ring[j]);
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < warmup + iters; i++) {
    if (i == warmup) t0 = MPI_Wtime();
    if (bibw && me < 2) {
      int peer = 1 - me;
      if (!sequential)
        for (int j = 0; j < WINDOW; j++)
          MPI_Irecv(rb, size, MPI_CHAR, peer, 100, MPI_COMM_WORLD, &req[j]);
      for (int j = 0; j < WINDOW; j++)
        MPI_Isend(sb, size, MPI_CHAR, peer, 100, MPI_COMM_WORLD, &sreq[j]);
      if (sequential)
        for (int j = 0; j < WINDOW; j++)
          MPI_Recv(rb, size, MPI_CHAR, peer, 100, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Waitall(WINDOW, sreq, MPI_STATUSES_IGNORE);
      if (!sequential) MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
    } else if (me == 0) {
      for (int j = 0; j < WINDOW; j++)
        MPI_Isend(sb, size, MPI_CHAR, 1, 100, MPI_COMM_WORLD, &req[j]);
      MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
      MPI_Recv(&ack, 1, MPI_CHAR, 1, 101, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else if (me == 1) {
      if (ahead) {
        for (int j = 0; j < WINDOW; j++) {
          MPI_Wait(&ring[next], MPI_STATUS_IGNORE);
          MPI_Irecv(slots + (size_t)next * size, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD,
                    &ring[next]);
          next = next + 1 == WINDOW ? 0 : next + 1;
        }
      } else if (sequential) {
        for (int j = 0; j < WINDOW; j++)
          MPI_Recv(rb, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        for (int j = 0; j < WINDOW; j++)
          MPI_Irecv(rb, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD, &req[j]);
        MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
      }
      MPI_Send(&ack, 1, MPI_CHAR, 0, 101, MPI_COMM_WORLD);
    }
  }
  double t = MPI_Wtime() - t0;
  if (ahead && me == 1)
    for (int j = 0; j < WINDOW; j++) {
      MPI_Cancel(&ring[j]);
      MPI_Wait(&ring[j], MPI_STATUS_IGNORE);
    }
  MPI_Bcast(&t, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return t;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int bibw = argc > 1 && strcmp(argv[1], "bibw") == 0;
  int rounds = argc > 2 ? atoi(argv[2]) : 5;
  int max = argc > 3 ? atoi(argv[3]) : 4096;
  if (n < 2 || rounds < 1 || rounds > MAX_ROUNDS || max < 1 ||
      (argc > 1 && !bibw && strcmp(argv[1], "bw") != 0)) {
    if (me == 0)
      fprintf(stderr, "usage: mpirun -np 2 receive_order [bw|bibw] [ROUNDS 1-64] [MAX_SIZE]\n");
    MPI_Finalize();
    return 2;
  }
  char *sb = aligned_alloc(4096, ((size_t)max + 4095) / 4096 * 4096);
  char *rb = aligned_alloc(4096, ((size_t)max + 4095) / 4096 * 4096);
  memset(sb, 'a', max);
  memset(rb, 'b', max);
  slots = aligned_alloc(4096, ((size_t)max * WINDOW + 4095) / 4096 * 4096);
  if (me == 0) {
    printf("# receive order, plain MPI, %s, window %d, best of %d rounds (MB/s)\n",
           bibw ? "bibw" : "bw", WINDOW, rounds);
    printf("# %-8s %14s %14s %14s %18s %20s\n", "Size", "posted", "sequential", "ahead",
           "seq/posted(median)", "ahead/posted(median)");
  }
  for (int size = 1; size <= max; size *= 2) {
    /* osu_bw's counts: 100 iterations and 10 warm-up up to 8 KiB, 20 and 2 above. */
    int iters = size <= 8192 ? 100 : 20, warmup = size <= 8192 ? 10 : 2;
    int orders = bibw ? 2 : 3;
    double best[3] = {0, 0, 0}, ratio[2][MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
      double bw[3] = {0, 0, 0};
      for (int k = 0; k < orders; k++) {
        int order = (k + r) % orders; /* which order goes first rotates by round */
        double t = run(me, bibw, order, sb, rb, size, iters, warmup);
        bw[order] = (double)size * iters * WINDOW * (bibw ? 2 : 1) / t / 1e6;
        if (bw[order] > best[order]) best[order] = bw[order];
      }
      ratio[0][r] = bw[1] / bw[0];
      ratio[1][r] = bw[2] / bw[0];
    }
    qsort(ratio[0], rounds, sizeof ratio[0][0], cmp);
    qsort(ratio[1], rounds, sizeof ratio[1][0], cmp);
    if (me == 0 && bibw)
      printf("%-10d %14.2f %14.2f %14s %18.3f %20s\n", size, best[0], best[1], "-",
             ratio[0][rounds / 2], "-");
    else if (me == 0)
      printf("%-10d %14.2f %14.2f %14.2f %18.3f %20.3f\n", size, best[0], best[1], best[2],
             ratio[0][rounds / 2], ratio[1][rounds / 2]);
  }
  free(sb);
  free(rb);
  free(slots);
  MPI_Finalize();
  return 0;
}
