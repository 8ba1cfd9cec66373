/* The MPI floor under tnt_comm's reduce_scatter / allgather (Note [Pairwise reduce-scatter]
 * in packages/tnt-comm/csrc/mpi_transport.cc), in plain C, without tnt_comm's engine:
 *
 *   mpicc -O2 benchmarks/mpi_scatter_gather.c -o /tmp/sg
 *   OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 mpirun -n 2 /tmp/sg [float32 elements]
 *
 * (the variable selects libnbc's ring for MPI_Iallreduce, as tnt_comm does: Note [libnbc
 * ring]). Every output is fresh memory with the huge-page advice (as tnt_comm's and numpy's
 * large buffers, Note [Huge pages for large buffers]). Kinds: blocking MPI_Reduce_scatter and
 * MPI_Allgatherv; non-blocking MPI_Ireduce_scatter / MPI_Iallgatherv / MPI_Iallreduce
 * completed by an MPI_Test loop (as the engine does); the pairwise reduce-scatter and
 * allgather (MPI_Isend/MPI_Irecv per peer, MPI_Reduce_local in rank order); and a memcpy of
 * the whole array into fresh memory (what writing an allgather's result costs at least).
 * Prints the median (min, max) over 9 repetitions of the slowest rank, after one warm-up.
 * Blocking and non-blocking libnbc-style calls cost alike, so the reduce-scatter's time is
 * its algorithm's, not a matter of how often the engine polls. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum { KINDS = 8, REPS = 9 };
static const char* NAMES[KINDS] = {
    "MPI_Reduce_scatter",   "MPI_Ireduce_scatter+Test", "pairwise reduce-scatter",
    "MPI_Allgatherv",       "MPI_Iallgatherv+Test",     "pairwise allgather",
    "MPI_Iallreduce+Test",  "memcpy into fresh memory"};

static void* fresh(long nbytes) {
  char* p = aligned_alloc(64, (size_t)((nbytes + 63) / 64 * 64));
  char* a = (char*)(((unsigned long)p + 4095) & ~4095UL);
  long span = (nbytes - (a - p)) & ~4095L;
  if (span > 0) madvise(a, (size_t)span, MADV_HUGEPAGE);
  return p;
}

static void wait_all(MPI_Request* r, int n) {
  int done = 0;
  while (!done) MPI_Testall(n, r, &done, MPI_STATUSES_IGNORE);
}

int main(int argc, char** argv) {
  int provided, rank, size;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const long n = argc > 1 ? atol(argv[1]) : 12600000; /* 50.4 MB of float32 */
  float* x = malloc((size_t)n * 4);
  for (long i = 0; i < n; i++) x[i] = (float)(i % 7 + rank);
  int* counts = malloc((size_t)size * sizeof(int));
  int* displs = malloc((size_t)size * sizeof(int));
  for (int p = 0; p < size; p++) {
    counts[p] = (int)(n / size + (p < n % size));
    displs[p] = p ? displs[p - 1] + counts[p - 1] : 0;
  }
  const int mine = counts[rank];
  float* block = malloc((size_t)mine * 4);
  memcpy(block, x + displs[rank], (size_t)mine * 4);
  MPI_Request* req = malloc(sizeof(MPI_Request) * 2 * (size_t)size);
  double times[KINDS][REPS];
  for (int k = -1; k < REPS; k++) {
    for (int kind = 0; kind < KINDS; kind++) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      int nr = 0;
      float* out = fresh((kind <= 2 ? mine : n) * 4L);
      switch (kind) {
        case 0: MPI_Reduce_scatter(x, out, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
        case 1:
          MPI_Ireduce_scatter(x, out, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, req);
          wait_all(req, 1);
          break;
        case 2: { /* the first other rank straight into out, the rest into scratch */
          const int first = rank == 0 ? 1 : 0;
          float* scratch = size > 2 ? fresh((long)mine * 4 * (size - 2)) : NULL;
          for (int p = 0, s = 0; p < size; p++) {
            if (p == rank) continue;
            float* into = p == first ? out : scratch + (long)(s++) * mine;
            MPI_Irecv(into, mine, MPI_FLOAT, p, 5, MPI_COMM_WORLD, &req[nr++]);
            MPI_Isend(x + displs[p], counts[p], MPI_FLOAT, p, 5, MPI_COMM_WORLD, &req[nr++]);
          }
          wait_all(req, nr);
          for (int p = 0, s = 0; p < size; p++) {
            if (p == first) continue;
            const float* in = p == rank ? block : scratch + (long)(s++) * mine;
            MPI_Reduce_local(in, out, mine, MPI_FLOAT, MPI_SUM);
          }
          free(scratch);
          break;
        }
        case 3: MPI_Allgatherv(block, mine, MPI_FLOAT, out, counts, displs, MPI_FLOAT, MPI_COMM_WORLD); break;
        case 4:
          MPI_Iallgatherv(block, mine, MPI_FLOAT, out, counts, displs, MPI_FLOAT, MPI_COMM_WORLD, req);
          wait_all(req, 1);
          break;
        case 5:
          for (int p = 0; p < size; p++) {
            if (p == rank) continue;
            MPI_Irecv(out + displs[p], counts[p], MPI_FLOAT, p, 6, MPI_COMM_WORLD, &req[nr++]);
            MPI_Isend(block, mine, MPI_FLOAT, p, 6, MPI_COMM_WORLD, &req[nr++]);
          }
          memcpy(out + displs[rank], block, (size_t)mine * 4);
          wait_all(req, nr);
          break;
        case 6:
          MPI_Iallreduce(x, out, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, req);
          wait_all(req, 1);
          break;
        case 7:
          memcpy(out, x, (size_t)n * 4);
          if (out[n / 2] < -1.0f) puts("");  /* keeps the copy */
          break;
      }
      free(out);
      double dt = MPI_Wtime() - t0, slowest;
      MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (k >= 0) times[kind][k] = slowest;
    }
  }
  if (rank == 0) printf("%d ranks, %.1f MB float32\n", size, n * 4e-6);
  for (int kind = 0; kind < KINDS; kind++) {
    double* t = times[kind];
    for (int i = 0; i < REPS; i++)
      for (int j = i + 1; j < REPS; j++)
        if (t[j] < t[i]) { double q = t[i]; t[i] = t[j]; t[j] = q; }
    if (rank == 0) printf("%-26s %7.1f ms (%.1f-%.1f)\n", NAMES[kind], t[REPS / 2] * 1e3, t[0] * 1e3, t[REPS - 1] * 1e3);
  }
  free(req); free(block); free(displs); free(counts); free(x);
  MPI_Finalize();
  return 0;
}
