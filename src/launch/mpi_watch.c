/* mpiflow's MPI watch: preloaded (LD_PRELOAD) into a program that `mpiflow launch`
 * supervises, so the launcher learns where the program's MPI stands, and can end a ps
 * task's MPI cleanly. See src/launch/watch.rs for the launcher's side and why.
 *
 * It defines MPI_Init, MPI_Init_thread and MPI_Finalize only (no MPI_Get_version: tools
 * such as mpi4py take a program that exports it for one linked with MPI) and calls the MPI
 * library's own functions through their profiling names (PMPI_*), found in whichever
 * loaded object exports them: the library may have been opened RTLD_LOCAL, out of
 * RTLD_NEXT's reach. These three functions take no MPI handle, so the one object works
 * with any MPI's ABI.
 *
 * Datagrams to the launcher's socket (Linux's abstract namespace, named by
 * MPIFLOW_MPI_WATCH): "init PID" once MPI is initialised, "finalizing PID" as the program
 * enters MPI_Finalize, "finalized PID" when it returned. After init it listens on a socket
 * of its own, named "<MPIFLOW_MPI_WATCH>/PID": on "finalize" (the launcher stops a task
 * whose program waits for ever, as a ps task's join() does) a thread of its own finalises
 * MPI and ends the process with status 0, so the other ranks' MPI_Finalize completes.
 *
 * Where the launcher itself took the rank's MPI to learn the cluster, MPIFLOW_MPI_TAKEN
 * is set: MPI_Init then prints it (if not empty) and exits 1, instead of failing inside
 * the MPI library with pages of help. Preloaded so (from /proc/self/fd, a descriptor of
 * this process's own), it removes itself from LD_PRELOAD at load, so that the program's
 * children do not look for a descriptor they may not have. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define ENV_NAME "MPIFLOW_MPI_WATCH"

struct lookup {
    const char *name;
    void *found;
};

static int find_in(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct lookup *l = data;
    if (info->dlpi_name == NULL || info->dlpi_name[0] == '\0') return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) return 0;
    l->found = dlsym(h, l->name);
    dlclose(h);
    return l->found != NULL;
}

/* The MPI library's `name` (a PMPI_ function): through the global scope, else in any
 * object loaded so far. */
static void *mpi_function(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (f != NULL) return f;
    struct lookup l = {name, NULL};
    dl_iterate_phdr(find_in, &l);
    if (l.found == NULL) {
        fprintf(stderr, "mpiflow launch: %s not found in the program's MPI library\n", name);
        abort();
    }
    return l.found;
}

/* Fills `a` with the abstract address `name` + `suffix`; its length. */
static socklen_t address(struct sockaddr_un *a, const char *name, const char *suffix) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "%s%s", name, suffix);
    if (n < 0 || (size_t)n >= sizeof a->sun_path - 1) return 0;
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void tell(const char *what) {
    const char *name = getenv(ENV_NAME);
    if (name == NULL) return;
    struct sockaddr_un a;
    socklen_t len = address(&a, name, "");
    if (len == 0) return;
    int s = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return;
    char msg[64];
    int n = snprintf(msg, sizeof msg, "%s %ld", what, (long)getpid());
    (void)sendto(s, msg, (size_t)n, 0, (struct sockaddr *)&a, len);
    close(s);
}

__attribute__((constructor)) static void forget_own_descriptor(void) {
    const char *p = getenv("LD_PRELOAD");
    if (p == NULL || strncmp(p, "/proc/self/fd/", 14) != 0) return;
    const char *rest = strchr(p, ':');
    if (rest != NULL) {
        setenv("LD_PRELOAD", rest + 1, 1);
    } else {
        unsetenv("LD_PRELOAD");
    }
}

static void refuse_if_taken(void) {
    const char *taken = getenv("MPIFLOW_MPI_TAKEN");
    if (taken == NULL) return;
    if (taken[0] != '\0') fprintf(stderr, "%s\n", taken);
    exit(1);
}

static int finalize_now(void) {
    static int (*real)(void);
    if (real == NULL) real = (int (*)(void))mpi_function("PMPI_Finalize");
    tell("finalizing");
    int rc = real();
    tell("finalized");
    return rc;
}

/* Waits for the launcher's "finalize" on this process's own socket. */
static void *listen_for_stop(void *arg) {
    int s = (int)(long)arg;
    char buf[16];
    for (;;) {
        ssize_t n = recv(s, buf, sizeof buf, 0);
        if (n == 8 && memcmp(buf, "finalize", 8) == 0) {
            finalize_now();
            _exit(0);
        }
        if (n < 0) return NULL;
    }
}

static void initialized(void) {
    const char *name = getenv(ENV_NAME);
    if (name == NULL) return;
    char suffix[32];
    snprintf(suffix, sizeof suffix, "/%ld", (long)getpid());
    struct sockaddr_un a;
    socklen_t len = address(&a, name, suffix);
    int s = len == 0 ? -1 : socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s >= 0 && bind(s, (struct sockaddr *)&a, len) == 0) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, listen_for_stop, (void *)(long)s) != 0) close(s);
        pthread_attr_destroy(&attr);
    } else if (s >= 0) {
        close(s);
    }
    tell("init");
}

int MPI_Init(int *argc, char ***argv) {
    refuse_if_taken();
    int (*real)(int *, char ***) = (int (*)(int *, char ***))mpi_function("PMPI_Init");
    int rc = real(argc, argv);
    if (rc == 0) initialized();
    return rc;
}

int MPI_Init_thread(int *argc, char ***argv, int required, int *provided) {
    refuse_if_taken();
    int (*real)(int *, char ***, int, int *) =
        (int (*)(int *, char ***, int, int *))mpi_function("PMPI_Init_thread");
    int rc = real(argc, argv, required, provided);
    if (rc == 0) initialized();
    return rc;
}

int MPI_Finalize(void) { return finalize_now(); }
