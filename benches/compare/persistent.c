/* Do MPI's persistent requests make small messages cheaper, in plain MPI?
 *
 *   mpicc -O2 -o target/persistent benches/compare/persistent.c
 *   mpirun -np 2 target/persistent [ROUNDS] [MAX_SIZE]
 *
 * A channel (src/transport/channel.rs) moves one tensor between two ranks again and
 * again: the shape MPI's persistent requests (MPI_Send_init/MPI_Recv_init once, then
 * MPI_Start and MPI_Wait per message) were made for. If they cost less per message than
 * MPI_Send/MPI_Recv, a channel built on them could pay for its checks and read faster
 * than osu_latency, and a window of them (MPI_Startall, one MPI_Waitall) faster than
 * osu_bw. This program measures that in plain MPI, the orders alternating in the same job
 * (which goes first rotates by round):
 *
 *   latency  blocking    MPI_Send, MPI_Recv (osu_latency)
 *            persistent  MPI_Start + MPI_Wait on a send and a receive made once per size
 *            isend       MPI_Isend + MPI_Wait, MPI_Recv (the send a request, not persistent)
 *   bw       osu         a window of 64 MPI_Isend from one buffer, 64 MPI_Irecv into one
 *                        buffer, MPI_Waitall on each, a 1-byte reply (osu_bw -b single)
 *            persistent  the sender's 64 sends and the receiver's 64 receives (into 64
 *                        buffers) made once per size, MPI_Startall + MPI_Waitall a window
 *            recv-only   osu's sender, the receiver's persistent receives as above
 *            multiple    osu's sender, 64 MPI_Irecv into 64 buffers (osu_bw -b multiple)
 *
 * Per size it prints the best latency (us) of the blocking and persistent orders over the
 * rounds, osu_bw's best bandwidth (MB/s), and the medians over rounds of the in-round
 * ratios to the blocking calls (latency: time) and to osu's window (bw: bandwidth).
 * Under Open MPI's pml ucx, `isend` shows what UCX does with MPI_Send from 16 KiB: it
 * stays eager up to UCX_RNDV_SEND_NBR_THRESH (256 KiB), where MPI_Isend turns to
 * rendezvous (src/transport/mpi/library.rs).
 * Used by benches/results/2026-11-27-receive.md (fifteenth look).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WINDOW 64
#define MAX_ROUNDS 64

enum { BLOCKING, PERSISTENT_LAT, ISEND, LAT_ORDERS };
enum { OSU, PERSISTENT, RECV_ONLY, MULTIPLE, BW_ORDERS };

/* The receiver's WINDOW buffers of the largest size. */
static char *slots;

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* One-way latency (us) of `iters` round trips after `warmup`, in one of the latency
 * orders. */
static double latency(int me, int order, char *sb, char *rb, int size, int iters,
                      int warmup) {
  MPI_Request s, r;
  int peer = 1 - me, persistent = order == PERSISTENT_LAT;
  double t0 = 0;
  if (persistent) {
    MPI_Send_init(sb, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD, &s);
    MPI_Recv_init(rb, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD, &r);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < warmup + iters; i++) {
    if (i == warmup) t0 = MPI_Wtime();
    for (int turn = 0; turn < 2; turn++) {
      int sending = (turn == 0) == (me == 0);
      if (persistent) {
        MPI_Request *q = sending ? &s : &r;
        MPI_Start(q);
        MPI_Wait(q, MPI_STATUS_IGNORE);
      } else if (sending && order == ISEND) {
        MPI_Isend(sb, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD, &s);
        MPI_Wait(&s, MPI_STATUS_IGNORE);
      } else if (sending) {
        MPI_Send(sb, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
      } else {
        MPI_Recv(rb, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      }
    }
  }
  double t = (MPI_Wtime() - t0) * 1e6 / (2.0 * iters);
  if (persistent) {
    MPI_Request_free(&s);
    MPI_Request_free(&r);
  }
  MPI_Bcast(&t, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return t;
}

/* Bandwidth (MB/s) of `iters` windows after `warmup`, in one of the bw orders. */
static double bandwidth(int me, int order, char *sb, char *rb, int size, int iters,
                        int warmup) {
  MPI_Request req[WINDOW], made[WINDOW];
  char ack = 0;
  double t0 = 0;
  int sender_made = order == PERSISTENT && me == 0;
  int receiver_made = (order == PERSISTENT || order == RECV_ONLY) && me == 1;
  for (int j = 0; j < WINDOW && sender_made; j++)
    MPI_Send_init(sb, size, MPI_CHAR, 1, 100, MPI_COMM_WORLD, &made[j]);
  for (int j = 0; j < WINDOW && receiver_made; j++)
    MPI_Recv_init(slots + (size_t)j * size, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD, &made[j]);
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < warmup + iters; i++) {
    if (i == warmup) t0 = MPI_Wtime();
    if (sender_made || receiver_made) {
      MPI_Startall(WINDOW, made);
      MPI_Waitall(WINDOW, made, MPI_STATUSES_IGNORE);
    } else if (me == 0) {
      for (int j = 0; j < WINDOW; j++)
        MPI_Isend(sb, size, MPI_CHAR, 1, 100, MPI_COMM_WORLD, &req[j]);
      MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
    } else {
      for (int j = 0; j < WINDOW; j++) {
        char *into = order == MULTIPLE ? slots + (size_t)j * size : rb;
        MPI_Irecv(into, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD, &req[j]);
      }
      MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
    }
    if (me == 0)
      MPI_Recv(&ack, 1, MPI_CHAR, 1, 101, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    else
      MPI_Send(&ack, 1, MPI_CHAR, 0, 101, MPI_COMM_WORLD);
  }
  double t = MPI_Wtime() - t0;
  for (int j = 0; j < WINDOW && (sender_made || receiver_made); j++)
    MPI_Request_free(&made[j]);
  MPI_Bcast(&t, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return (double)size * iters * WINDOW / t / 1e6;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int rounds = argc > 1 ? atoi(argv[1]) : 10;
  int max = argc > 2 ? atoi(argv[2]) : 4096;
  if (n != 2 || rounds < 1 || rounds > MAX_ROUNDS || max < 1) {
    if (me == 0) fprintf(stderr, "usage: mpirun -np 2 persistent [ROUNDS 1-64] [MAX_SIZE]\n");
    MPI_Finalize();
    return 2;
  }
  size_t page = ((size_t)max + 4095) / 4096 * 4096;
  char *sb = aligned_alloc(4096, page), *rb = aligned_alloc(4096, page);
  slots = aligned_alloc(4096, ((size_t)max * WINDOW + 4095) / 4096 * 4096);
  memset(sb, 'a', max);
  memset(rb, 'b', max);
  memset(slots, 'b', (size_t)max * WINDOW);
  if (me == 0) {
    printf("# persistent requests, plain MPI, best of %d rounds; ratios: medians of in-round "
           "ratios\n", rounds);
    printf("# %-7s %9s %9s %10s %10s | %9s %10s %10s %10s\n", "Size", "lat(us)", "pers(us)",
           "pers/lat", "isend/lat", "bw(MB/s)", "pers/osu", "recv/osu", "mult/osu");
  }
  for (int size = 1; size <= max; size *= 2) {
    /* osu_latency's and osu_bw's counts by size. */
    int li = size <= 8192 ? 10000 : 1000, lw = size <= 8192 ? 1000 : 100;
    int bi = size <= 8192 ? 100 : 20, bw_warmup = size <= 8192 ? 10 : 2;
    double best_lat[2] = {1e30, 1e30}, best_osu = 0, lat_ratio[LAT_ORDERS][MAX_ROUNDS];
    double bw_ratio[BW_ORDERS][MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
      double l[LAT_ORDERS], b[BW_ORDERS];
      for (int k = 0; k < LAT_ORDERS; k++) {
        int o = (k + r) % LAT_ORDERS;
        l[o] = latency(me, o, sb, rb, size, li, lw);
        if (o < 2 && l[o] < best_lat[o]) best_lat[o] = l[o];
      }
      for (int k = 0; k < BW_ORDERS; k++) {
        int o = (k + r) % BW_ORDERS;
        b[o] = bandwidth(me, o, sb, rb, size, bi, bw_warmup);
      }
      if (b[OSU] > best_osu) best_osu = b[OSU];
      for (int o = 1; o < LAT_ORDERS; o++) lat_ratio[o][r] = l[o] / l[BLOCKING];
      for (int o = 1; o < BW_ORDERS; o++) bw_ratio[o][r] = b[o] / b[OSU];
    }
    for (int o = 1; o < LAT_ORDERS; o++) qsort(lat_ratio[o], rounds, sizeof lat_ratio[o][0], cmp);
    for (int o = 1; o < BW_ORDERS; o++) qsort(bw_ratio[o], rounds, sizeof bw_ratio[o][0], cmp);
    if (me == 0)
      printf("%-9d %9.3f %9.3f %10.3f %10.3f | %9.2f %10.3f %10.3f %10.3f\n", size,
             best_lat[0], best_lat[1], lat_ratio[PERSISTENT_LAT][rounds / 2],
             lat_ratio[ISEND][rounds / 2], best_osu, bw_ratio[PERSISTENT][rounds / 2],
             bw_ratio[RECV_ONLY][rounds / 2], bw_ratio[MULTIPLE][rounds / 2]);
  }
  free(sb);
  free(rb);
  free(slots);
  MPI_Finalize();
  return 0;
}
