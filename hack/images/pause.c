/*
 * pause: the process that holds a pod sandbox's namespaces (fractional-dra's own, written from
 * scratch; built static by hack/images/build.py into localhost/fractional-pause).
 *
 *   - blocks until SIGINT or SIGTERM, then exits 0;
 *   - as PID 1 of the sandbox's PID namespace it reaps every child that dies (SIGCHLD), so no
 *     zombie outlives its parent;
 *   - `pause -v` prints the version and exits 0.
 *
 * The three signals are blocked and taken synchronously with sigwaitinfo(); they also get a
 * (never run) handler, so that none of them has SIG_DFL, which the kernel discards for the init
 * of a PID namespace.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef PAUSE_VERSION
#define PAUSE_VERSION "3.10-local"
#endif

static void unused_handler(int sig) { (void)sig; }

static void reap_children(void) {
  for (;;) {
    pid_t pid = waitpid(-1, NULL, WNOHANG);
    if (pid > 0) {
      continue;
    }
    if (pid < 0 && errno == EINTR) {
      continue;
    }
    return; /* 0: children left, none exited; -1 ECHILD: no children at all */
  }
}

static int usage(FILE *out, const char *prog, int code) {
  fprintf(out, "usage: %s [-v]\n  blocks until SIGINT or SIGTERM, reaping children; -v: version\n",
          prog);
  return code;
}

int main(int argc, char **argv) {
  const char *prog = argc > 0 ? argv[0] : "pause";
  if (argc > 2) {
    return usage(stderr, prog, 2);
  }
  if (argc == 2) {
    if (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0) {
      printf("pause version %s (fractional-dra)\n", PAUSE_VERSION);
      return 0;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
      return usage(stdout, prog, 0);
    }
    return usage(stderr, prog, 2);
  }
  if (getpid() != 1) {
    fprintf(stderr, "pause: warning: not PID 1; orphaned processes are not reaped here\n");
  }

  sigset_t wanted;
  sigemptyset(&wanted);
  sigaddset(&wanted, SIGINT);
  sigaddset(&wanted, SIGTERM);
  sigaddset(&wanted, SIGCHLD);
  if (sigprocmask(SIG_BLOCK, &wanted, NULL) != 0) {
    perror("pause: sigprocmask");
    return 1;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = unused_handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0 ||
      sigaction(SIGCHLD, &sa, NULL) != 0) {
    perror("pause: sigaction");
    return 1;
  }
  /* Children may already be dead (inherited from a runtime that set us up): reap them first. */
  reap_children();

  for (;;) {
    siginfo_t info;
    int sig = sigwaitinfo(&wanted, &info);
    if (sig < 0) {
      if (errno == EINTR) {
        continue;
      }
      perror("pause: sigwaitinfo");
      return 1;
    }
    if (sig == SIGCHLD) {
      reap_children();
      continue;
    }
    fprintf(stderr, "pause: shutting down, got signal %d\n", sig);
    return 0;
  }
}
