/* MPI's own cost of a refit's rounds, with nothing of jreshard: the floor under benchmarks/engine_bench.py's
 * "engine host" line. Two processes; process 0 plays the rank, process 1 all its peers.
 *
 *   mpi_floor COUNTS STEPS
 *
 * COUNTS is a file of int32: the number of groups, then per group the rank's sends and receives. Every message is
 * 0 bytes (the engine_bench's prepared column cuts its rows to 0 B). Every request of every group is built once
 * (MPI_Send_init / MPI_Recv_init, as jreshard's prepared MPI groups); each step then, group after group, starts
 * the group's requests (MPI_Startall) and tests each in order until it completes (MPI_Test, as the compiled
 * replay polls). Process 1 posts the mirror: a receive for each send, a send for each receive. MPI is initialised
 * at MPI_THREAD_MULTIPLE (mpi4py's default) or, with a third argument "serialized", MPI_THREAD_SERIALIZED.
 *
 * Prints one line: "floor <median> <min> <max> <calls>": process 0's time a group, in us, over the STEPS steps
 * after one warm-up step, and its MPI_Test calls a group.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int wanted = argc > 3 && strcmp(argv[3], "serialized") == 0 ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE;
    int provided, me, size;
    MPI_Init_thread(&argc, &argv, wanted, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 3 || size != 2 || provided != wanted) {
        if (me == 0) {
            fprintf(stderr, "mpi_floor: usage: mpiexec -n 2 mpi_floor COUNTS STEPS [serialized] (provided %d)\n",
                    provided);
        }
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    FILE *f = fopen(argv[1], "rb");
    int32_t groups = 0;
    if (f == NULL || fread(&groups, sizeof groups, 1, f) != 1 || groups <= 0 || groups > (1 << 24)) {
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    int32_t *counts = malloc(2 * sizeof(int32_t) * (size_t)groups);
    if (counts == NULL || fread(counts, 2 * sizeof(int32_t), (size_t)groups, f) != (size_t)groups) {
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    fclose(f);
    long total = 0;
    for (int32_t g = 0; g < groups; g++) {
        if (counts[2 * g] < 0 || counts[2 * g + 1] < 0 || counts[2 * g] + counts[2 * g + 1] > 65536) {
            MPI_Abort(MPI_COMM_WORLD, 3);
        }
        total += counts[2 * g] + counts[2 * g + 1];
    }
    int steps = atoi(argv[2]);
    if (steps < 1) {
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    MPI_Request *reqs = malloc(sizeof(MPI_Request) * (size_t)(total > 0 ? total : 1));
    long *first = malloc(sizeof(long) * ((size_t)groups + 1));
    double *times = malloc(sizeof(double) * (size_t)steps);
    char scratch[1];
    int peer = 1 - me;
    long at = 0;
    for (int32_t g = 0; g < groups; g++) {
        int sends = counts[2 * g], recvs = counts[2 * g + 1];
        first[g] = at;
        /* Process 0 sends with tags 0.., receives with tags 65536..; process 1 the mirror. */
        for (int k = 0; k < (me == 0 ? sends : recvs); k++) {
            MPI_Send_init(scratch, 0, MPI_BYTE, peer, me == 0 ? k : 65536 + k, MPI_COMM_WORLD, &reqs[at++]);
        }
        for (int k = 0; k < (me == 0 ? recvs : sends); k++) {
            MPI_Recv_init(scratch, 0, MPI_BYTE, peer, me == 0 ? 65536 + k : k, MPI_COMM_WORLD, &reqs[at++]);
        }
    }
    first[groups] = at;
    long calls = 0;
    for (int step = 0; step <= steps; step++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        calls = 0;
        for (int32_t g = 0; g < groups; g++) {
            long lo = first[g], hi = first[g + 1];
            MPI_Startall((int)(hi - lo), reqs + lo);
            for (long k = lo; k < hi; k++) {
                int done = 0;
                while (!done) {
                    MPI_Test(&reqs[k], &done, MPI_STATUS_IGNORE);
                    calls++;
                }
            }
        }
        if (step > 0) {
            times[step - 1] = (now() - t0) / groups * 1e6;
        }
    }
    if (me == 0) {
        qsort(times, (size_t)steps, sizeof(double), by_value);
        printf("floor %.3f %.3f %.3f %.2f\n", times[steps / 2], times[0], times[steps - 1], (double)calls / groups);
    }
    for (long k = 0; k < total; k++) {
        MPI_Request_free(&reqs[k]);
    }
    free(reqs);
    free(first);
    free(times);
    free(counts);
    MPI_Finalize();
    return 0;
}
