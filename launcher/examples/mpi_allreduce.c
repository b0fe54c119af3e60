/* A program that itself uses MPI, for `mpiflow launch` (tests and the README): it
 * initialises MPI as its rank, sums the ranks by MPI_Allreduce over MPI_COMM_WORLD and
 * prints one line with what the launcher exported:
 *   rank R size N sum S task JOB:INDEX tf_config yes|no
 * With --ps-joins a ps task then waits for ever without finalising MPI, as TensorFlow's
 * server.join() does: `mpiflow launch` still ends the job when the workers are done.
 * Build: mpicc -O2 -o mpi_allreduce mpi_allreduce.c (mpicc.mpich for MPICH). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int mine = rank + 1, sum = 0;
  MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  const char *job = getenv("MPIFLOW_JOB");
  const char *index = getenv("MPIFLOW_TASK_INDEX");
  printf("rank %d size %d sum %d task %s:%s tf_config %s\n", rank, size, sum,
         job ? job : "none", index ? index : "none", getenv("TF_CONFIG") ? "yes" : "no");
  fflush(stdout);
  if (argc > 1 && strcmp(argv[1], "--ps-joins") == 0 && job && strcmp(job, "ps") == 0) {
    for (;;) pause();
  }
  MPI_Finalize();
  return 0;
}
