/* osu_allreduce's timed loop in a program of its own, to tell OSU's method from OSU's
 * program.
 *
 *   mpicc -O2 -o target/allreduce_loop benches/compare/allreduce_loop.c
 *   mpirun -np 2 target/allreduce_loop [char|int8|int|float] [dup]
 *
 * The loop of osu_allreduce.c (OMB 7.4) on MPI_COMM_WORLD, sizes 4-64 KiB: page-aligned
 * send and receive buffers allocated once at the largest size (bytes 1 and 0), per size
 * a barrier, then 100 untimed and 1000 timed iterations up to 8 KiB (10 and 100 above),
 * each MPI_Allreduce (MPI_SUM) timed on its own by MPI_Wtime and followed by a
 * barrier; the average over ranks of each rank's mean, in microseconds, as OSU prints it.
 * The elements are MPI_CHAR by default, as osu_allreduce's (its `-T`, default mpi_char),
 * or MPI_INT8_T, MPI_INT or MPI_FLOAT. With `dup`, MPI_Comm_dup(MPI_COMM_WORLD) first,
 * kept alive, as mpiflow's communicator is (in Open MPI 4.1 the duplicate's context id
 * is agreed by a non-blocking allreduce, and libnbc's progress function then stays
 * registered for the whole job).
 *
 * mpiflow's `bench allreduce --path mpi` makes the same calls; run them beside
 * osu_allreduce in alternating jobs (benches/results/2026-11-25-osu.md, sixth pass).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Datatype type = MPI_CHAR;
    const char *type_name = "MPI_CHAR";
    for (int a = 1; a < argc; a++) {
        if (strcmp(argv[a], "dup") == 0 && dup == MPI_COMM_NULL) {
            MPI_Comm_dup(MPI_COMM_WORLD, &dup);
        } else if (strcmp(argv[a], "int8") == 0) {
            type = MPI_INT8_T, type_name = "MPI_INT8_T";
        } else if (strcmp(argv[a], "int") == 0) {
            type = MPI_INT, type_name = "MPI_INT";
        } else if (strcmp(argv[a], "float") == 0) {
            type = MPI_FLOAT, type_name = "MPI_FLOAT";
        }
    }
    int type_size;
    MPI_Type_size(type, &type_size);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const size_t max = 65536;
    void *send = NULL, *recv = NULL;
    if (posix_memalign(&send, 4096, max) || posix_memalign(&recv, 4096, max)) {
        fprintf(stderr, "allreduce_loop: no memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(send, 1, max);
    memset(recv, 0, max);
    if (rank == 0) {
        printf("# %s, %s\n# Size       Avg Latency(us)\n", type_name,
               dup == MPI_COMM_NULL ? "world" : "world, after MPI_Comm_dup");
    }
    for (size_t bytes = 4096; bytes <= max; bytes *= 2) {
        int large = bytes > 8192;
        int iters = large ? 100 : 1000, skip = large ? 10 : 100;
        double timer = 0.0;
        MPI_Barrier(MPI_COMM_WORLD);
        for (int i = 0; i < iters + skip; i++) {
            double t0 = MPI_Wtime();
            MPI_Allreduce(send, recv, (int)(bytes / type_size), type, MPI_SUM, MPI_COMM_WORLD);
            double t1 = MPI_Wtime();
            if (i >= skip) {
                timer += t1 - t0;
            }
            MPI_Barrier(MPI_COMM_WORLD);
        }
        double mine = timer * 1e6 / iters, sum = 0.0;
        MPI_Reduce(&mine, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("%-10zu %18.2f\n", bytes, sum / size);
        }
    }
    if (dup != MPI_COMM_NULL) {
        MPI_Comm_free(&dup);
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
