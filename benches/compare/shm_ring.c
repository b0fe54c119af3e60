/* Could a ring in shared memory carry small messages between two ranks of a node faster
 * than MPI does? Plain C, before building anything.
 *
 *   mpicc -O2 -o target/shm_ring benches/compare/shm_ring.c
 *   mpirun -np 2 target/shm_ring [ROUNDS] [MAX_SIZE]
 *
 * A single-producer single-consumer ring of 64 slots in a shared-memory window
 * (MPI_Win_allocate_shared), one per direction: slot k holds a sequence word and the
 * payload, cache-line aligned; the sender waits for a free slot (the consumer's count,
 * read again only when the ring looks full), copies the payload, and publishes the
 * sequence with a release store; the receiver spins on the sequence (acquire), copies
 * the payload out and publishes its count.
 *
 * Orders alternate in each round, the first rotating by round:
 *   latency: MPI_Send/MPI_Recv ping-pong (osu_latency) against the ring's;
 *   bw: osu_bw -b single (64 MPI_Isend from one buffer, 64 MPI_Irecv into one buffer,
 *       MPI_Waitall, a 1-byte reply) against 64 ring sends and 64 ring receives into one
 *       buffer and a ring reply.
 * Per size: each order's best over the rounds, and the median of the in-round ratios.
 */
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WINDOW 64
#define SLOTS 64
#define MAX_ROUNDS 64
#define LINE 64

typedef struct {
  volatile uint64_t consumed; /* written by the receiver */
  char pad[LINE - 8];
} Control;

typedef struct {
  Control *ctl;  /* the consumer's count */
  char *slots;   /* SLOTS slots of `stride` bytes */
  size_t stride;
  uint64_t next; /* the producer's next sequence, or the consumer's expected one */
  uint64_t seen; /* the producer's last read of `consumed` */
} Ring;

static size_t stride_of(int size) { return ((size_t)size + 8 + LINE - 1) / LINE * LINE; }

static void ring_send(Ring *r, const char *buf, int size) {
  while (r->next - r->seen >= SLOTS) {
    r->seen = __atomic_load_n(&r->ctl->consumed, __ATOMIC_ACQUIRE);
  }
  char *slot = r->slots + (r->next % SLOTS) * r->stride;
  memcpy(slot + 8, buf, size);
  __atomic_store_n((uint64_t *)slot, r->next + 1, __ATOMIC_RELEASE);
  r->next++;
}

static void ring_recv(Ring *r, char *buf, int size) {
  char *slot = r->slots + (r->next % SLOTS) * r->stride;
  while (__atomic_load_n((uint64_t *)slot, __ATOMIC_ACQUIRE) != r->next + 1) {
  }
  memcpy(buf, slot + 8, size);
  r->next++;
  __atomic_store_n(&r->ctl->consumed, r->next, __ATOMIC_RELEASE);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Seconds per iteration. */
static double latency(int me, int ring, Ring *out, Ring *in, char *sb, char *rb, int size,
                      int iters) {
  double t0 = 0;
  for (int i = 0; i < iters + iters / 10; i++) {
    if (i == iters / 10) t0 = MPI_Wtime();
    if (me == 0) {
      if (ring) {
        ring_send(out, sb, size);
        ring_recv(in, rb, size);
      } else {
        MPI_Send(sb, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
        MPI_Recv(rb, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      }
    } else {
      if (ring) {
        ring_recv(in, rb, size);
        ring_send(out, sb, size);
      } else {
        MPI_Recv(rb, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(sb, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
      }
    }
  }
  return (MPI_Wtime() - t0) / iters / 2;
}

/* MB/s. */
static double bw(int me, int ring, Ring *out, Ring *in, char *sb, char *rb, int size,
                 int iters) {
  MPI_Request req[WINDOW];
  char ack = 0;
  double t0 = 0;
  for (int i = 0; i < iters + iters / 10; i++) {
    if (i == iters / 10) t0 = MPI_Wtime();
    if (me == 0) {
      if (ring) {
        for (int j = 0; j < WINDOW; j++) ring_send(out, sb, size);
        ring_recv(in, &ack, 1);
      } else {
        for (int j = 0; j < WINDOW; j++)
          MPI_Isend(sb, size, MPI_CHAR, 1, 100, MPI_COMM_WORLD, &req[j]);
        MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
        MPI_Recv(&ack, 1, MPI_CHAR, 1, 101, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      }
    } else {
      if (ring) {
        for (int j = 0; j < WINDOW; j++) ring_recv(in, rb, size);
        ring_send(out, &ack, 1);
      } else {
        for (int j = 0; j < WINDOW; j++)
          MPI_Irecv(rb, size, MPI_CHAR, 0, 100, MPI_COMM_WORLD, &req[j]);
        MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
        MPI_Send(&ack, 1, MPI_CHAR, 0, 101, MPI_COMM_WORLD);
      }
    }
  }
  double t = MPI_Wtime() - t0;
  return (double)size * iters * WINDOW / t / 1e6;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int rounds = argc > 1 ? atoi(argv[1]) : 10;
  int max = argc > 2 ? atoi(argv[2]) : 8192;
  if (rounds > MAX_ROUNDS) rounds = MAX_ROUNDS;
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  size_t bytes = LINE + SLOTS * stride_of(max);
  char *mine;
  MPI_Win win;
  MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, node, &mine, &win);
  memset(mine, 0, bytes);
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Aint sz;
  int du;
  char *theirs;
  MPI_Win_shared_query(win, 1 - me, &sz, &du, &theirs);
  char *sb = aligned_alloc(4096, max + 4096), *rb = aligned_alloc(4096, max + 4096);
  memset(sb, 'a', max);
  memset(rb, 0, max);
  double lat[2][MAX_ROUNDS], band[2][MAX_ROUNDS];
  if (me == 0) printf("# size  lat_mpi_best lat_ring_best ring/mpi(median)  bw_mpi_best bw_ring_best ring/mpi(median)\n");
  for (int size = 1; size <= max; size *= 2) {
    /* my ring to them lives in their segment, theirs to me in mine */
    for (int r = 0; r < rounds; r++) {
      for (int k = 0; k < 2; k++) {
        int ring = (k + r) % 2;
        /* fresh rings each measurement */
        MPI_Barrier(MPI_COMM_WORLD);
        memset(mine, 0, bytes);
        MPI_Barrier(MPI_COMM_WORLD);
        Ring out = {(Control *)theirs, theirs + LINE, stride_of(size), 0, 0};
        Ring in = {(Control *)mine, mine + LINE, stride_of(size), 0, 0};
        int iters = size <= 1024 ? 20000 : 5000;
        lat[ring][r] = latency(me, ring, &out, &in, sb, rb, size, iters);
        MPI_Barrier(MPI_COMM_WORLD);
        memset(mine, 0, bytes);
        MPI_Barrier(MPI_COMM_WORLD);
        Ring out2 = {(Control *)theirs, theirs + LINE, stride_of(size), 0, 0};
        Ring in2 = {(Control *)mine, mine + LINE, stride_of(size), 0, 0};
        band[ring][r] = bw(me, ring, &out2, &in2, sb, rb, size, size <= 1024 ? 2000 : 500);
      }
    }
    if (me == 0) {
      double lr[MAX_ROUNDS], br[MAX_ROUNDS], lb[2] = {1e9, 1e9}, bb[2] = {0, 0};
      for (int r = 0; r < rounds; r++) {
        lr[r] = lat[1][r] / lat[0][r];
        br[r] = band[1][r] / band[0][r];
        for (int k = 0; k < 2; k++) {
          if (lat[k][r] < lb[k]) lb[k] = lat[k][r];
          if (band[k][r] > bb[k]) bb[k] = band[k][r];
        }
      }
      qsort(lr, rounds, sizeof(double), cmp);
      qsort(br, rounds, sizeof(double), cmp);
      printf("%-7d %9.3f us %9.3f us %6.2f    %10.1f %10.1f %6.2f\n", size, lb[0] * 1e6,
             lb[1] * 1e6, lr[rounds / 2], bb[0], bb[1], br[rounds / 2]);
      fflush(stdout);
    }
  }
  MPI_Win_free(&win);
  MPI_Finalize();
  return 0;
}
