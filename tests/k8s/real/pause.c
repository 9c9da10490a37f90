/* The pod sandbox's process for chaosgpu's test node: exit on INT/TERM, reap children on CHLD,
 * otherwise sleep. Built static (gcc -Os -static) into the pause image by images.py. */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signum) { (void)signum; _exit(0); }

static void on_child(int signum) {
    (void)signum;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_stop;
    sigaction(SIGINT, &action, NULL);
    sigaction(SIGTERM, &action, NULL);
    action.sa_handler = on_child;
    action.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &action, NULL);
    for (;;) {
        pause();
    }
}
